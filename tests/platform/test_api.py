import json

import pytest

from loom.api.errors import UNAUTHORIZED
from loom.runs import states
from loom.runs.hardware import launch_gpus, launch_warnings, planner_gpu
from loom.runs.models import Run
from trainer.plan.hardware import GPU_TYPES

from .helpers import TINY_CONFIG, claimed_run

pytestmark = pytest.mark.django_db


def api(client, method, path, token=None, body=None):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    kwargs = {"data": json.dumps(body), "content_type": "application/json"} if body is not None else {}
    return getattr(client, method)(path, **kwargs, **headers)


def test_create_run_returns_201_with_id_and_queued_attempt(client, platform_user, token_for):
    token = token_for(platform_user[0])
    response = api(client, "post", "/api/runs", token, {"name": "tiny", "config": TINY_CONFIG})
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["state"] == states.QUEUED
    assert [a["number"] for a in body["attempts"]] == [1]
    assert body["config"]["model"]["dim"] == 64
    assert body["config"]["optimizer"]["beta2"] == 0.95  # defaults are filled in and stored
    assert Run.objects.get(pk=body["id"]).owner == platform_user[0]


def test_create_run_with_bad_fields_is_400_with_field_errors_and_creates_nothing(client, platform_user, token_for):
    token = token_for(platform_user[0])
    config = {**TINY_CONFIG, "model": {**TINY_CONFIG["model"], "heads": 3}, "parallel": {"dp_shard": 0}}
    response = api(client, "post", "/api/runs", token, {"name": "", "config": config})
    assert response.status_code == 400
    errors = response.json()["errors"]
    assert errors["name"] == "is required"
    assert "must divide dim=64" in errors["config.model.heads"]
    assert "greater than or equal to 1" in errors["config.parallel.dp_shard"]
    assert not Run.objects.exists()


def test_create_run_warns_of_bf16_and_a_prediction_for_gpus_the_launcher_does_not_have(
    client, platform_user, token_for
):
    token = token_for(platform_user[0])
    config = {**TINY_CONFIG, "compute": {"precision": "bf16"}}
    cluster = {"gpu": "H100-SXM", "nodes": 1, "gpus_per_node": 2}
    response = api(client, "post", "/api/runs", token, {"name": "planned", "config": config, "cluster": cluster})
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["estimate"]["cluster"]["gpu"] == "H100-SXM"
    assert body["warnings"] == launch_warnings(body["config"], body["estimate"], launch_gpus())
    if not launch_gpus():
        assert body["warnings"] == {
            "config.compute.precision": "bf16 but the launcher has no GPU (torch on its machine sees no CUDA "
            "device): the ranks will compute in bf16 on CPU with gloo; auto trains in fp32 there",
            "cluster.gpu": "the estimate is for 2 × H100-SXM but the launcher has no GPU: the ranks will train "
            "on CPU, where the prediction does not apply",
        }
    plain = api(client, "post", "/api/runs", token, {"name": "plain", "config": TINY_CONFIG})
    assert plain.status_code == 201 and plain.json()["warnings"] == {}
    assert Run.objects.count() == 2


def test_the_launchers_gpus_can_be_stated_where_the_web_process_does_not_share_its_machine(
    client, platform_user, token_for, settings
):
    token = token_for(platform_user[0])
    planned = {
        "name": "planned",
        "config": {**TINY_CONFIG, "compute": {"precision": "bf16"}},
        "cluster": {"gpu": "H100-SXM", "nodes": 1, "gpus_per_node": 2},
    }
    settings.LOOM_LAUNCH_GPUS = "NVIDIA H100 80GB HBM3, NVIDIA H100 80GB HBM3"
    assert launch_gpus() == ("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3")
    response = api(client, "post", "/api/runs", token, planned)
    assert response.status_code == 201 and response.json()["warnings"] == {}
    settings.LOOM_LAUNCH_GPUS = "none"
    response = api(client, "post", "/api/runs", token, planned)
    assert set(response.json()["warnings"]) == {"config.compute.precision", "cluster.gpu"}


def test_launch_warnings_compare_the_estimate_with_the_launchers_gpus():
    config = {"compute": {"precision": "bf16"}}
    estimate = {"cluster": {"gpu": "H100-SXM", "nodes": 2, "gpus_per_node": 8}}
    assert launch_warnings(config, estimate, ("NVIDIA H100 80GB HBM3",)) == {}
    assert launch_warnings(config, None, ("NVIDIA A100-SXM4-40GB",)) == {}
    assert launch_warnings(config, estimate, ("NVIDIA A100-SXM4-80GB",)) == {
        "cluster.gpu": "the estimate is for 16 × H100-SXM but the launcher's GPUs are NVIDIA A100-SXM4-80GB: "
        "the prediction does not apply to them; estimate on A100-80GB instead"
    }
    assert "the planner has no figures for them" in launch_warnings(config, estimate, ("Tesla T4",))["cluster.gpu"]
    assert set(launch_warnings(config, estimate, ())) == {"config.compute.precision", "cluster.gpu"}
    assert launch_warnings({"compute": {"precision": "fp32"}}, None, ()) == {}
    # Hardware torch could not be asked about warns of nothing.
    assert launch_warnings(config, estimate, None) == {}


@pytest.mark.parametrize(
    ("device_name", "gpu_type"),
    [
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("NVIDIA B200", "B200"),
        ("Tesla V100-SXM2-16GB", None),
    ],
)
def test_a_gpu_as_torch_names_it_is_the_planners_gpu_type(device_name, gpu_type):
    assert planner_gpu(device_name) == gpu_type
    assert gpu_type is None or gpu_type in GPU_TYPES


def test_unknown_config_field_is_named(client, platform_user, token_for):
    token = token_for(platform_user[0])
    response = api(client, "post", "/api/runs", token, {"name": "x", "config": {"modle": {}}})
    assert response.status_code == 400
    assert response.json()["errors"] == {"config.modle": "is not a known field"}


def test_list_and_detail_show_only_own_runs(client, platform_user, other_user, token_for):
    mine, _, _ = claimed_run(platform_user[0], "mine")
    theirs, _, _ = claimed_run(other_user, "theirs")
    token = token_for(platform_user[0])
    listed = api(client, "get", "/api/runs", token).json()
    assert [r["name"] for r in listed["runs"]] == ["mine"]
    detail = api(client, "get", f"/api/runs/{mine.pk}", token)
    assert detail.status_code == 200 and detail.json()["attempts"][0]["state"] == states.STARTING
    for path in (f"/api/runs/{theirs.pk}", f"/api/runs/{theirs.pk}/events", f"/api/runs/{theirs.pk}/attempts/1/logs/0"):
        assert api(client, "get", path, token).status_code == 404
    assert api(client, "post", f"/api/runs/{theirs.pk}/cancel", token).status_code == 404
    theirs.refresh_from_db()
    assert theirs.state == states.STARTING


def test_events_after_pages_through_the_log(client, platform_user, token_for):
    run, attempt, attempt_token = claimed_run(platform_user[0])
    for seq in range(3):
        batch = {"attempt": attempt.pk, "rank": 0, "seq": seq,
                 "events": [{"kind": "metric", "time": 1.0, "step": seq, "payload": {"loss": 1.0}}]}  # fmt: skip
        client.post("/api/ingest", json.dumps(batch), "application/json", HTTP_AUTHORIZATION=f"Bearer {attempt_token}")
    token = token_for(platform_user[0])
    first = api(client, "get", f"/api/runs/{run.pk}/events?after=0&limit=2", token).json()
    assert [e["seq"] for e in first["events"]] == [1, 2] and first["more"] is True
    rest = api(client, "get", f"/api/runs/{run.pk}/events?after=2", token).json()
    assert rest["more"] is False
    # queued, the claim's starting, then the three metrics
    assert rest["last_seq"] == rest["events"][-1]["seq"] == 5
    pages = first["events"] + rest["events"]
    assert [e["seq"] for e in pages] == [1, 2, 3, 4, 5]
    assert [e["step"] for e in pages if e["kind"] == "metric"] == [0, 1, 2]


def test_cancel_queued_run_cancels_at_once_and_second_cancel_conflicts(client, platform_user, token_for):
    from loom.runs.services import create_run

    run = create_run(platform_user[0], "queued", TINY_CONFIG)
    token = token_for(platform_user[0])
    response = api(client, "post", f"/api/runs/{run.pk}/cancel", token)
    assert response.status_code == 202 and response.json()["state"] == states.CANCELLED
    assert api(client, "post", f"/api/runs/{run.pk}/cancel", token).status_code == 409
    kinds = [(e.kind, e.payload.get("state")) for e in run.events.order_by("seq")]
    assert kinds == [("state", states.QUEUED), ("state", states.CANCELLED)]


def test_cancel_running_attempt_asks_the_launcher(client, platform_user, token_for):
    run, attempt, _ = claimed_run(platform_user[0])
    response = api(client, "post", f"/api/runs/{run.pk}/cancel", token_for(platform_user[0]))
    assert response.json()["state"] == states.CANCELLING
    attempt.refresh_from_db()
    assert attempt.cancel_requested and attempt.state == states.CANCELLING


def test_session_auth_requires_csrf_for_writes(platform_user):
    from django.test import Client

    client = Client(enforce_csrf_checks=True)
    client.force_login(platform_user[0])
    response = client.post("/api/runs", json.dumps({"name": "x", "config": TINY_CONFIG}), "application/json")
    assert response.status_code in (401, 403)
    assert not Run.objects.exists()
    assert client.get("/api/runs").status_code == 200


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/api/runs"),
        ("post", "/api/runs"),
        ("get", "/api/runs/{id}"),
        ("patch", "/api/runs/{id}"),
        ("get", "/api/runs/{id}/events"),
        ("post", "/api/runs/{id}/cancel"),
        ("get", "/api/runs/{id}/attempts/1/logs/0"),
    ],
)
def test_anonymous_and_bad_token_are_refused_everywhere(client, platform_user, method, path):
    run, _, _ = claimed_run(platform_user[0])
    url = path.format(id=run.pk)
    body = {} if method in ("post", "patch") else None
    assert api(client, method, url, body=body).status_code == 401
    assert api(client, method, url, token="loom_wrong", body=body).status_code == 401
    run.refresh_from_db()
    assert run.state == states.STARTING


def test_attempt_token_is_not_a_user_token(client, platform_user):
    _, _, attempt_token = claimed_run(platform_user[0])
    assert api(client, "get", "/api/runs", attempt_token).status_code == 401


def test_openapi_schema_is_for_logged_in_users_and_documents_the_routes(client, platform_user):
    assert client.get("/api/openapi.json").status_code == 302
    assert client.get("/api/docs").status_code == 302
    client.force_login(platform_user[0])
    docs = client.get("/api/docs")
    assert docs.status_code == 200
    # Swagger UI from this server: a deployment without internet access still shows the docs.
    assert "/static/ninja/swagger-ui-bundle.js" in docs.content.decode()
    assert client.get("/static/ninja/swagger-ui-bundle.js").status_code == 200
    schema = client.get("/api/openapi.json").json()
    routes = ("/api/runs", "/api/runs/{run_id}", "/api/runs/{run_id}/events", "/api/runs/{run_id}/cancel")
    for route in (*routes, "/api/ingest"):
        assert route in schema["paths"], route
    assert "requestBody" in schema["paths"]["/api/ingest"]["post"]


def test_openapi_schema_answers_a_script_with_its_api_token(client, platform_user, token_for):
    response = api(client, "get", "/api/openapi.json", token_for(platform_user[0]))
    assert response.status_code == 200
    assert "/api/runs" in response.json()["paths"]
    refused = api(client, "get", "/api/openapi.json", "loom_not-a-token")
    assert refused.status_code == 401
    assert refused.json() == {"errors": {"authorization": UNAUTHORIZED}}
    _, _, attempt_token = claimed_run(platform_user[0])
    assert api(client, "get", "/api/openapi.json", attempt_token).status_code == 401


def test_an_invalid_parallel_layout_is_refused_before_launch(client, platform_user, token_for):
    config = {**TINY_CONFIG, "parallel": {"tp": 3}}
    response = api(client, "post", "/api/runs", token_for(platform_user[0]), {"name": "bad layout", "config": config})
    assert response.status_code == 400
    assert response.json()["errors"] == {
        "config.parallel.tp": "must divide model.heads=4; valid choices are [1, 2]",
        "config.model.seq_len": "must be divisible by 3 (tp = 3 sequence-parallel shards)",
    }
    assert not Run.objects.exists()


def test_a_three_dimensional_layout_is_accepted(client, platform_user, token_for):
    config = {**TINY_CONFIG, "parallel": {"pp": 2, "dp_shard": 2, "tp": 2, "microbatches": 2}}
    response = api(client, "post", "/api/runs", token_for(platform_user[0]), {"name": "3d", "config": config})
    assert response.status_code == 201
    assert response.json()["config"]["parallel"]["pp_schedule"] == "1F1B"
