"""The planner API (estimate, search, traffic, export, catalog), the designer page's access, and
runs created with a cluster keeping their estimate: Django's test client against the real database."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from django.test import Client

from loom.runs.models import Run

from .helpers import TINY_CONFIG

pytestmark = pytest.mark.django_db

REPO = Path(__file__).resolve().parents[2]
LLAMA3_8B_TP2 = {
    "model": {"preset": "llama3-8b"},
    "parallel": {"tp": 2, "dp_shard": 4},
    # Under tensor parallelism loom's trainer runs torch's norm and SwiGLU, whose fp32 intermediates leave
    # room for one 8,192-token sequence per rank on an H100.
    "data": {"micro_batch": 1},
    "compute": {"precision": "bf16"},
}
ONE_H100_NODE = {"gpu": "H100-SXM", "nodes": 1}
TINY_MODEL = {key: TINY_CONFIG["model"][key] for key in ("layers", "dim", "heads", "kv_heads", "ffn", "seq_len")}


@pytest.fixture
def token(platform_user, token_for):
    return token_for(platform_user[0])


def post(client, path, body, token=None):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    return client.post(path, json.dumps(body), "application/json", **headers)


def field_errors(response) -> dict[str, str]:
    assert response.status_code == 400, response.content
    return response.json()["errors"]


def with_changes(document: dict, **sections) -> dict:
    return {**document, **{name: {**document.get(name, {}), **fields} for name, fields in sections.items()}}


def test_estimate_answers_memory_time_and_throughput_with_their_terms(client, token):
    response = post(client, "/api/plan/estimate", {"config": LLAMA3_8B_TP2, "cluster": ONE_H100_NODE}, token)
    assert response.status_code == 200, response.content
    estimate = response.json()
    assert estimate["config"]["model"]["layers"] == 32  # the preset, filled in
    assert estimate["layout"]["world_size"] == 8
    memory = estimate["memory"]
    assert memory["capacity_bytes"] == 81_559 * 2**20  # nvidia-smi's total for an H100 80GB
    assert memory["usable_bytes"] < memory["capacity_bytes"]
    assert memory["headroom_bytes"] == pytest.approx(memory["usable_bytes"] - memory["peak_bytes"])
    (rank,) = estimate["memory"]["ranks"]
    assert {"parameters", "optimizer states", "activations"} <= {term["name"] for term in rank["terms"]}
    assert all(term["formula"] for term in rank["terms"])
    assert estimate["memory"]["fits"] is True
    assert {"compute", "optimizer step"} <= {term["name"] for term in estimate["time"]["terms"]}
    assert estimate["tokens_per_s"] > 0 and 0 < estimate["mfu"] < 1
    assert estimate["timeline"] is None


def test_a_pipelined_estimate_draws_its_schedule(client, token):
    config = with_changes(
        LLAMA3_8B_TP2, parallel={"tp": 2, "dp_shard": 2, "pp": 2, "microbatches": 2}, data={"micro_batch": 2}
    )
    response = post(client, "/api/plan/estimate", {"config": config, "cluster": ONE_H100_NODE}, token)
    assert response.status_code == 200, response.content
    timeline = response.json()["timeline"]
    assert timeline["pp"] == 2 and timeline["schedule"] == "1F1B"
    assert {op["k"] for op in timeline["ops"]} >= {"F", "B"}
    assert {op["r"] for op in timeline["ops"]} == {0, 1}
    assert len(response.json()["memory"]["ranks"]) == 2


@pytest.mark.parametrize(
    ("config", "cluster", "field", "message"),
    [
        (with_changes(LLAMA3_8B_TP2, parallel={"tp": 3}), ONE_H100_NODE, "parallel.tp", "must divide model.heads=32"),
        ({"model": {"preset": "llama5"}}, ONE_H100_NODE, "model.preset", "unknown preset 'llama5'"),
        (LLAMA3_8B_TP2, {"gpu": "Z80", "nodes": 1}, "cluster.gpu", "unknown GPU type 'Z80'"),
        (with_changes(LLAMA3_8B_TP2, parallel={"dp_shard": 8}), ONE_H100_NODE, "cluster.nodes", "needs 16 GPUs"),
        ({**LLAMA3_8B_TP2, "data": {"micro_batch": "two"}}, ONE_H100_NODE, "data.micro_batch", "valid integer"),
    ],
)
def test_a_bad_layout_is_a_400_naming_the_field(client, token, config, cluster, field, message):
    errors = field_errors(post(client, "/api/plan/estimate", {"config": config, "cluster": cluster}, token))
    assert message in errors[field]


def test_the_api_and_the_cli_estimate_a_bare_preset_alike_with_the_planning_defaults(client, token, tmp_path):
    bare = {"model": {"preset": "llama3-8b"}}
    response = post(client, "/api/plan/estimate", {"config": bare}, token)
    assert response.status_code == 200, response.content
    from_api = response.json()
    document = tmp_path / "bare.json"
    document.write_text(json.dumps(bare))
    cli = subprocess.run(
        [sys.executable, "-m", "trainer.plan", "estimate", str(document), "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout) == from_api
    assert from_api["defaults"] == {
        "compute.precision": "bf16",
        "compute.recompute": "selective",
        "data.micro_batch": 1,
        "parallel.dp_shard": 8,
    }
    assert from_api["memory"]["fits"]


def test_an_unknown_preset_is_a_400_naming_the_presets(client, token):
    estimate = field_errors(post(client, "/api/plan/estimate", {"config": {"model": {"preset": "llama3-71b"}}}, token))
    assert "'llama3-70b'" in estimate["model.preset"]
    body = {"model": {"preset": "llama3-71b"}, "global_batch": 8}
    assert "'llama3-70b'" in field_errors(post(client, "/api/plan/search", body, token))["model.preset"]


def test_export_returns_the_demo_learning_rate_warning_and_the_defaults_it_took(client, token):
    bare = {"model": {"preset": "llama3-70b"}, "parallel": {"tp": 8, "dp_shard": 8}}
    answer = post(client, "/api/plan/export", {"config": bare, "format": "megatron"}, token).json()
    assert "--lr=0.003 \\" in answer["text"].splitlines()
    assert [warning["field"] for warning in answer["warnings"]] == ["optimizer.lr"]
    assert answer["defaults"] == {"compute.precision": "bf16", "compute.recompute": "selective", "data.micro_batch": 1}
    chosen = with_changes(bare, optimizer={"lr": 1.5e-4})
    assert post(client, "/api/plan/export", {"config": chosen, "format": "megatron"}, token).json()["warnings"] == []


def test_the_catalog_lists_presets_gpus_and_schedules(client, token):
    response = client.get("/api/plan/catalog", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 200
    catalog = response.json()
    presets = {preset["name"]: preset["model"] for preset in catalog["presets"]}
    assert presets["llama3-70b"]["layers"] == 80
    gpus = {gpu["name"]: gpu for gpu in catalog["gpus"]}
    assert gpus["H100-SXM"]["memory_bytes"] == 81_559 * 2**20
    assert gpus["H100-SXM"]["peak_bf16_tflops"] == pytest.approx(989)
    assert "ZBVZeroBubble" in catalog["schedules"]


def test_search_ranks_layouts_and_marks_the_pareto_front(client, token):
    body = {"model": TINY_MODEL, "cluster": {"gpu": "H100-SXM", "nodes": 1}, "global_batch": 16, "limit": 5}
    response = post(client, "/api/plan/search", body, token)
    assert response.status_code == 200, response.content
    found = response.json()
    assert 0 < len(found["results"]) <= 5
    assert [result["rank"] for result in found["results"]] == list(range(1, len(found["results"]) + 1))
    throughputs = [result["tokens_per_s"] for result in found["results"]]
    assert throughputs == sorted(throughputs, reverse=True)
    best = found["results"][0]
    assert best["config"]["model"]["dim"] == TINY_MODEL["dim"] and best["summary"]
    assert found["pareto"] and found["evaluated"] >= found["valid"] >= found["fitting"] > 0


def test_search_keeps_only_what_the_trainer_runs_when_asked(client, token):
    # The trainer runs a mixture of experts without tensor parallelism only: a long ranking holds some that use it.
    mixture = {**TINY_MODEL, "experts": 4, "top_k": 2}
    body = {"model": mixture, "cluster": ONE_H100_NODE, "global_batch": 16, "limit": 100}
    every = post(client, "/api/plan/search", body, token).json()
    assert not all(result["runnable"] for result in every["results"])
    response = post(client, "/api/plan/search", {**body, "runnable_only": True}, token)
    assert response.status_code == 200, response.content
    runnable = response.json()
    assert runnable["results"] and all(result["runnable"] for result in runnable["results"] + runnable["pareto"])
    refused = field_errors(post(client, "/api/plan/search", {**body, "runnable_only": "yes"}, token))
    assert set(refused) == {"runnable_only"}


def test_search_refuses_bad_request_fields(client, token):
    body = {"model": TINY_MODEL, "cluster": ONE_H100_NODE, "global_batch": 0, "precision": "fp4"}
    errors = field_errors(post(client, "/api/plan/search", body, token))
    assert set(errors) == {"global_batch", "precision"}
    too_many = field_errors(post(client, "/api/plan/search", {**body, "global_batch": 16, "limit": 1000}, token))
    assert too_many == {"limit": "must be at most 100 layouts"}


def test_traffic_is_a_rank_by_rank_matrix_split_by_kind(client, token):
    config = {**TINY_CONFIG, "parallel": {"dp_replicate": 2, "tp": 2}}
    response = post(client, "/api/plan/traffic", {"config": config, "cluster": ONE_H100_NODE}, token)
    assert response.status_code == 200, response.content
    matrix = response.json()
    assert matrix["world_size"] == 4
    assert len(matrix["bytes"]) == 4 and all(len(row) == 4 for row in matrix["bytes"])
    assert all(matrix["bytes"][rank][rank] == 0 for rank in range(4))
    assert {"tp", "dp"} <= set(matrix["by_kind"])
    # Ranks 0 and 1 are one tp group (tp innermost); ranks 0 and 2 hold the same shard in two replicas.
    assert matrix["by_kind"]["tp"][0][1] > 0 and matrix["by_kind"]["tp"][0][2] == 0
    assert matrix["by_kind"]["dp"][0][2] > 0 and matrix["by_kind"]["dp"][0][1] == 0


def test_traffic_for_more_than_1024_ranks_is_refused(client, token):
    config = with_changes(LLAMA3_8B_TP2, parallel={"tp": 8, "dp_shard": 256})
    response = post(client, "/api/plan/traffic", {"config": config, "cluster": {"nodes": 256}}, token)
    assert "1024" in " ".join(field_errors(response).values())


@pytest.mark.parametrize(
    ("export_format", "expected"),
    [("torchtitan", "tensor_parallel_degree = 2"), ("megatron", "--tensor-model-parallel-size")],
)
def test_export_writes_the_layout_for_another_trainer(client, token, export_format, expected):
    response = post(client, "/api/plan/export", {"config": LLAMA3_8B_TP2, "format": export_format}, token)
    assert response.status_code == 200, response.content
    assert response.json()["format"] == export_format
    assert expected in response.json()["text"]


def test_export_prices_the_layout_for_the_trainer_it_goes_to(client, token):
    config = with_changes(LLAMA3_8B_TP2, compute={"recompute": "selective"})
    body = {"config": config, "format": "megatron", "cluster": ONE_H100_NODE}
    estimates = post(client, "/api/plan/export", body, token).json()["estimates"]
    assert set(estimates) == {"loom", "megatron"}
    # Megatron's selective recompute repeats only the attention core and hides its backward tp collectives.
    assert estimates["megatron"]["step_s"] < estimates["loom"]["step_s"]
    assert post(client, "/api/plan/export", {"config": config, "format": "megatron"}, token).json()["estimates"] is None
    errors = field_errors(post(client, "/api/plan/export", {**body, "cluster": {"gpu": "TPU"}}, token))
    assert "cluster.gpu" in errors


def test_export_refuses_a_layout_the_other_trainer_cannot_run_naming_the_field(client, token):
    config = with_changes(LLAMA3_8B_TP2, parallel={"pp": 2, "pp_schedule": "ZBVZeroBubble", "stages_per_rank": 2,
                                                   "microbatches": 2}, data={"micro_batch": 2})  # fmt: skip
    errors = field_errors(post(client, "/api/plan/export", {"config": config, "format": "megatron"}, token))
    assert "1F1B or Interleaved1F1B" in errors["parallel.pp_schedule"]
    # Priced for the trainer it goes to too: refused before either.
    parallel = {"config": with_changes(LLAMA3_8B_TP2, model={"parallel_blocks": True}), "cluster": ONE_H100_NODE}
    for export_format in ("megatron", "torchtitan"):
        errors = field_errors(post(client, "/api/plan/export", {**parallel, "format": export_format}, token))
        assert list(errors) == ["model.parallel_blocks"]


def test_export_refuses_an_unknown_format_and_a_bad_config_together(client, token):
    body = {"config": with_changes(LLAMA3_8B_TP2, parallel={"tp": 3}), "format": "deepspeed"}
    errors = field_errors(post(client, "/api/plan/export", body, token))
    assert "format" in errors and "parallel.tp" in errors


@pytest.mark.parametrize(
    ("method", "path"),
    [("get", "/api/plan/catalog"), ("post", "/api/plan/estimate"), ("post", "/api/plan/search"),
     ("post", "/api/plan/traffic"), ("post", "/api/plan/export")],
)  # fmt: skip
def test_the_planner_api_needs_a_user(client, method, path):
    body = {"config": LLAMA3_8B_TP2, "cluster": ONE_H100_NODE}
    response = post(client, path, body) if method == "post" else client.get(path)
    assert response.status_code == 401
    bad_token = {"HTTP_AUTHORIZATION": "Bearer loom_wrong"}
    response = (
        client.post(path, json.dumps(body), "application/json", **bad_token)
        if method == "post"
        else (client.get(path, **bad_token))
    )
    assert response.status_code == 401


def test_pages_post_to_the_planner_with_their_session_and_csrf_token(platform_user):
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(platform_user[0])
    page = browser.get("/plan/")
    body = json.dumps({"config": LLAMA3_8B_TP2, "cluster": ONE_H100_NODE})
    assert browser.post("/api/plan/estimate", body, "application/json").status_code in (401, 403)
    csrf = page.cookies["csrftoken"].value
    assert browser.post("/api/plan/estimate", body, "application/json", HTTP_X_CSRFTOKEN=csrf).status_code == 200


def test_the_designer_page_needs_a_login_and_offers_the_layout_fields(client, platform_user):
    response = client.get("/plan/")
    assert response.status_code == 302 and response["Location"] == "/login/?next=/plan/"
    client.force_login(platform_user[0])
    response = client.get("/plan/")
    assert response.status_code == 200
    page = response.content.decode()
    for path in (
        "model.heads",
        "model.parallel_blocks",
        "parallel.tp",
        "parallel.pp_schedule",
        "parallel.zero_stage",
        "compute.recompute",
        "data.micro_batch",
        "cluster.gpu",
        "cluster.gpus_per_node",
    ):
        assert f'data-path="{path}"' in page, path
    assert "/static/design.js" in page and "/static/plotly/plotly.min.js" in page
    assert 'href="/plan/"' in page  # the nav link


def test_a_run_created_with_a_cluster_keeps_its_estimate(client, token):
    response = post(client, "/api/runs", {"name": "planned", "config": TINY_CONFIG, "cluster": ONE_H100_NODE}, token)
    assert response.status_code == 201, response.content
    stored = Run.objects.get(pk=response.json()["id"]).estimate
    assert stored["cluster"]["gpu"] == "H100-SXM"
    assert stored["layout"]["world_size"] == 2 and stored["data_parallel"] == 2
    assert stored["memory"]["peak_bytes"] > 0 and stored["tokens_per_s"] > 0
    assert "ranks" not in stored["memory"] and "comm" not in stored  # the summary, not the whole estimate
    assert response.json()["estimate"] == stored


def test_a_run_created_without_a_cluster_has_no_estimate(client, token):
    response = post(client, "/api/runs", {"name": "unplanned", "config": TINY_CONFIG}, token)
    assert response.status_code == 201, response.content
    assert response.json()["estimate"] is None
    assert Run.objects.get(pk=response.json()["id"]).estimate is None


def test_a_run_with_a_bad_cluster_is_refused_and_nothing_is_stored(client, token):
    body = {"name": "", "config": TINY_CONFIG, "cluster": {"gpu": "Z80"}}
    errors = field_errors(post(client, "/api/runs", body, token))
    assert set(errors) == {"name", "cluster.gpu"}
    assert not Run.objects.exists()


def test_a_run_the_trainer_cannot_run_is_refused_even_though_the_planner_estimates_it(client, token):
    # Expert parallelism across replicas: the planner prices it, the trainer does not run it yet.
    model = {**TINY_CONFIG["model"], "experts": 4, "top_k": 2}
    config = {**TINY_CONFIG, "model": model, "parallel": {"dp_replicate": 2, "ep": 2}}
    assert post(client, "/api/plan/estimate", {"config": config, "cluster": ONE_H100_NODE}, token).status_code == 200
    errors = field_errors(post(client, "/api/runs", {"name": "moe", "config": config, "cluster": ONE_H100_NODE}, token))
    assert "config.parallel.ep" in errors
    assert not Run.objects.exists()
