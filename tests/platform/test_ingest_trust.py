"""Ingest trusts a token for exactly its attempt and its ranks, and takes only what it can store: a batch is
stored or refused with the field named, and a refused batch never holds back the rank's later ones."""

import http.client
import json
import time
from datetime import timedelta

import pytest
from celery.contrib.testing.worker import start_worker
from django.test import Client
from django.utils import timezone

from loom.celery import app as celery_app
from loom.runs import states
from loom.runs.backends.local_supervisor import report_final_state
from loom.runs.launcher import work_dir_for
from loom.runs.models import Attempt, Run
from loom.runs.services import create_run
from loom.telemetry.models import Event, IngestBatch, IngestConflict
from trainer.telemetry import TelemetryClient, deliver_spool, read_spool

from ..conftest import ReconcilerLoop, wait_for
from .helpers import TINY_CONFIG, batch, claimed_run, event_count

pytestmark = pytest.mark.django_db


def post(client: Client, body, token: str, content_type: str = "application/json"):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return client.post("/api/ingest", data=data, content_type=content_type, HTTP_AUTHORIZATION=f"Bearer {token}")


def finish(attempt: Attempt, seconds_ago: float) -> None:
    finished_at = timezone.now() - timedelta(seconds=seconds_ago)
    Attempt.objects.filter(pk=attempt.pk).update(state=states.SUCCEEDED, finished_at=finished_at)


def test_a_finished_attempts_token_stores_within_the_grace_and_is_refused_after_it(client, platform_user, settings):
    run, attempt, token = claimed_run(platform_user[0])
    finish(attempt, seconds_ago=60)
    settings.LOOM_INGEST_GRACE_S = 120
    assert post(client, batch(attempt, seq=0), token).status_code == 200
    settings.LOOM_INGEST_GRACE_S = 30
    refused = post(client, batch(attempt, seq=1), token)
    assert refused.status_code == 401
    assert "expired" in refused.json()["errors"]["token"]
    assert event_count(run, kind="metric") == 3
    assert not IngestBatch.objects.filter(attempt=attempt, seq=1).exists()


def test_a_token_first_seen_while_its_attempt_ran_is_refused_once_it_has_finished(client, platform_user, settings):
    run, attempt, token = claimed_run(platform_user[0])
    assert post(client, batch(attempt, seq=0), token).status_code == 200
    finish(attempt, seconds_ago=10)
    # With no grace the process reads the attempt again at once, instead of trusting what it saw a moment ago.
    settings.LOOM_INGEST_GRACE_S = 0
    assert post(client, batch(attempt, seq=1), token).status_code == 401
    assert event_count(run, kind="metric") == 3


def test_a_finished_attempts_token_reads_its_pins_within_the_grace_and_not_after_it(client, platform_user, settings):
    run, attempt, token = claimed_run(platform_user[0])
    finish(attempt, seconds_ago=60)

    def pins():
        return client.get("/api/checkpoints/pinned", HTTP_AUTHORIZATION=f"Bearer {token}")

    settings.LOOM_INGEST_GRACE_S = 120
    assert pins().status_code == 200
    settings.LOOM_INGEST_GRACE_S = 30
    refused = pins()
    assert refused.status_code == 401 and "expired" in refused.json()["errors"]["token"]


def test_a_rank_beyond_the_attempts_world_size_is_refused(client, platform_user):
    run, attempt, token = claimed_run(platform_user[0])  # 2 ranks
    response = post(client, batch(attempt, rank=57), token)
    assert response.status_code == 400
    assert "world size 2" in response.json()["errors"]["rank"]
    assert post(client, batch(attempt, rank=1), token).status_code == 200
    assert set(run.events.filter(kind="metric").values_list("rank", flat=True)) == {1}


def test_a_negative_step_is_refused(client, platform_user):
    run, attempt, token = claimed_run(platform_user[0])
    response = post(client, batch(attempt, steps=(1, -3)), token)
    assert response.status_code == 400
    assert "events.1.step" in response.json()["errors"]
    assert event_count(run, kind="metric") == 0


def test_a_body_that_is_not_application_json_is_refused(client, platform_user):
    run, attempt, token = claimed_run(platform_user[0])
    before = event_count(run)
    response = post(client, batch(attempt), token, content_type="text/plain")
    assert response.status_code == 415
    assert "application/json" in response.json()["errors"]["content_type"]
    assert event_count(run) == before


@pytest.mark.parametrize(
    ("rank", "state", "accepted"),
    [
        (0, "started", True),
        (1, "finished", True),
        (0, states.SUCCEEDED, False),
        (-1, states.RUNNING, True),
        (-1, "finished", False),
    ],
)
def test_only_the_launcher_reports_the_attempts_lifecycle(client, platform_user, rank, state, accepted):
    run, attempt, token = claimed_run(platform_user[0])
    body = {
        "attempt": attempt.pk,
        "rank": rank,
        "seq": 0,
        "events": [{"kind": "state", "time": time.time(), "payload": {"state": state}}],
    }
    response = post(client, body, token)
    assert response.status_code == (200 if accepted else 400), response.content
    if not accepted:
        assert "events.0.payload.state" in response.json()["errors"]
    assert event_count(run, kind="state", rank=rank) == (1 if accepted else 0)
    attempt.refresh_from_db()
    assert attempt.state == (states.RUNNING if accepted and rank == -1 else states.STARTING)


def test_the_same_seq_with_other_events_is_a_conflict_kept_aside(client, platform_user):
    run, attempt, token = claimed_run(platform_user[0])
    original = batch(attempt, rank=1, seq=4)
    assert post(client, original, token).status_code == 200
    assert post(client, original, token).json() == {"stored": 0, "duplicate": True}
    different = batch(attempt, rank=1, seq=4, steps=(7,))
    response = post(client, different, token)
    assert response.status_code == 409
    assert "kept aside" in response.json()["errors"]["seq"]
    assert sorted(run.events.filter(kind="metric").values_list("step", flat=True)) == [1, 2, 3]
    (kept,) = IngestConflict.objects.filter(attempt=attempt, rank=1, seq=4)
    assert [event["step"] for event in kept.events] == [7]


def test_payload_key_order_does_not_make_a_resent_batch_a_conflict(client, platform_user):
    _, attempt, token = claimed_run(platform_user[0])
    first = event_body(attempt.pk, 0, metric('{"a": 1, "b": 2}'))
    again = event_body(attempt.pk, 0, metric('{"b": 2, "a": 1}'))
    assert post(client, first, token).status_code == 200
    assert post(client, again, token).json() == {"stored": 0, "duplicate": True}


def event_body(attempt_id: int, seq: int, event: str, rank: str = "0") -> str:
    return f'{{"attempt": {attempt_id}, "rank": {rank}, "seq": {seq}, "events": [{event}]}}'


def metric(payload: str, time_s: str = "1700000000.0", step: str = "1") -> str:
    return f'{{"kind": "metric", "time": {time_s}, "step": {step}, "payload": {payload}}}'


# (what, the batch body given the attempt id and seq, the field the refusal names)
POISON = [
    ("seq 2**63", lambda a, s: event_body(a, 2**63, metric("{}")), "seq"),
    ("rank 2**31", lambda a, s: event_body(a, s, metric("{}"), rank=str(2**31)), "rank"),
    ("step 2**63", lambda a, s: event_body(a, s, metric("{}", step=str(2**63))), "events.0.step"),
    ("time 1e20", lambda a, s: event_body(a, s, metric("{}", time_s="1e20")), "events.0.time"),
    ("10**400 in a payload", lambda a, s: event_body(a, s, metric(f'{{"loss": {10**400}}}')), "events.0.payload.loss"),
    ("1e400 in a payload", lambda a, s: event_body(a, s, metric('{"loss": 1e400}')), "events.0.payload.loss"),
    ("NUL in a string", lambda a, s: event_body(a, s, metric('{"host": "a\\u0000b"}')), "events.0.payload.host"),
    ("NUL in a key", lambda a, s: event_body(a, s, metric('{"a\\u0000b": 1}')), "events.0.payload"),
    (
        "5,000-deep nesting",
        lambda a, s: event_body(a, s, metric('{"x": ' * 5000 + "1" + "}" * 5000)),
        "events.0.payload",
    ),
    ("40-deep nesting", lambda a, s: event_body(a, s, metric('{"x": ' * 40 + "1" + "}" * 40)), "events.0.payload"),
]


def http_post(url: str, token: str, body: bytes, content_type: str = "application/json") -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        headers = {"Content-Type": content_type, "Authorization": f"Bearer {token}"}
        connection.request("POST", "/api/ingest", body=body, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.mark.parametrize(("poison", "make_body", "field"), POISON, ids=[case[0] for case in POISON])
def test_a_poison_batch_is_refused_naming_the_field_and_the_ranks_next_batch_still_lands(
    platform_server, platform_user, tmp_path, poison, make_body, field
):
    run, attempt, token = claimed_run(platform_user[0])
    body = make_body(attempt.pk, 0).encode()
    status, answer = http_post(platform_server.url, token, body)
    assert status == 400, (poison, answer)
    (named,) = answer["errors"]
    assert named.startswith(field), (poison, answer)

    # As the client meets it: spooled first, before the rank's next batch, and delivered oldest first.
    rank_dir = tmp_path / "rank0"
    rank_dir.mkdir()
    (rank_dir / "0000000000.json").write_bytes(body)
    (rank_dir / "0000000001.json").write_text(event_body(attempt.pk, 1, metric('{"loss": 2.5}', step="9")))
    assert deliver_spool(tmp_path, platform_server.url, token, deadline_s=30) == 0
    assert [path.name for path in (tmp_path / "rejected").iterdir()] == ["rank0-0000000000.json"]
    assert list(run.events.filter(kind="metric").values_list("step", "payload")) == [(9, {"loss": 2.5})]


def test_the_client_sets_a_conflicting_batch_aside_and_delivers_its_next_one(
    platform_server, platform_user, tmp_path, capsys
):
    run, attempt, token = claimed_run(platform_user[0])
    status, _ = http_post(platform_server.url, token, event_body(attempt.pk, 0, metric('{"loss": 1.0}')).encode())
    assert status == 200
    # A rank that lost its spool numbers its batches from 0 again.
    client = TelemetryClient(platform_server.url, token, attempt.pk, 0, tmp_path, 0.05, None)
    client.emit("metric", {"loss": 3.0}, step=2)
    time.sleep(0.3)
    client.emit("metric", {"loss": 4.0}, step=3)
    assert client.close(timeout_s=20) == 0
    assert "HTTP 409" in capsys.readouterr().err
    assert [path.name for path in (tmp_path / "rejected").iterdir()] == ["rank0-0000000000.json"]
    assert sorted(run.events.filter(kind="metric").values_list("step", flat=True)) == [1, 3]
    assert IngestConflict.objects.filter(attempt=attempt, rank=0, seq=0).count() == 1


def test_the_endpoint_refuses_a_body_that_is_not_application_json(platform_server, platform_user):
    run, attempt, token = claimed_run(platform_user[0])
    body = json.dumps(batch(attempt)).encode()
    status, answer = http_post(platform_server.url, token, body, content_type="text/plain")
    assert status == 415 and "application/json" in answer["errors"]["content_type"]
    assert http_post(platform_server.url, token, body, content_type="application/json; charset=utf-8")[0] == 200
    assert event_count(run, kind="metric") == 3


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"attempt": 1, "rank": 0, "seq": 0, "events": ["\xff"]}', "body"),
        (b'{"attempt": 1, "rank": 0, "seq": 0, "events": 5}', "events"),
        (b"[]", "body"),
    ],
    ids=["not UTF-8", "events not a list", "not an object"],
)
def test_malformed_bodies_are_answered_in_json_naming_what_is_wrong(platform_server, platform_user, body, field):
    _, _, token = claimed_run(platform_user[0])
    status, answer = http_post(platform_server.url, token, body)
    assert status == 400 and field in answer["errors"], answer


@pytest.mark.django_db(transaction=True)
def test_a_real_rank_sets_a_refused_batch_aside_trains_on_and_the_launcher_counts_it(
    platform_server, platform_user, settings
):
    settings.LOOM_CANCEL_GRACE_S = 5.0
    run = create_run(platform_user[0], "poisoned spool", TINY_CONFIG)
    attempt = run.attempts.get()
    # Left in rank 0's spool before it starts, as a batch the platform will never take: the rank's client
    # sends it first, has it refused, sets it aside and delivers every batch of its own after it.
    rank_dir = work_dir_for(attempt) / "spool" / "rank0"
    rank_dir.mkdir(parents=True)
    (rank_dir / "0000000000.json").write_text(event_body(attempt.pk, 0, metric("{}", time_s="1e20")))
    # The worker starts only now: the launch was queued when the run was created.
    with (
        start_worker(celery_app, pool="threads", concurrency=1, perform_ping_check=False, loglevel="WARNING"),
        ReconcilerLoop(interval_s=0.5),
    ):
        run = wait_for(
            lambda: Run.objects.filter(pk=run.pk, state__in=states.TERMINAL).first(), timeout=240, message="the run"
        )
    assert run.state == states.SUCCEEDED
    assert sorted(run.events.filter(kind="metric", rank=0).values_list("step", flat=True)) == list(range(1, 21))
    final = run.events.filter(kind="state", rank=-1, payload__state=states.SUCCEEDED).get()
    assert final.payload["batches_set_aside"] == 1
    assert [path.name for path in (work_dir_for(attempt) / "spool" / "rejected").iterdir()] == ["rank0-0000000000.json"]
    # The run's page and API say so on the attempt.
    client = Client()
    client.force_login(platform_user[0])
    (shown,) = client.get(f"/api/runs/{run.pk}").json()["attempts"]
    assert shown["batches_set_aside"] == 1


def test_the_launchers_final_report_counts_the_batches_set_aside(tmp_path):
    work_dir = tmp_path / "work"
    for folder, count in (("spool", 2), ("launcher-spool", 1)):
        rejected = work_dir / folder / "rejected"
        rejected.mkdir(parents=True)
        for seq in range(count):
            (rejected / f"rank0-{seq:010d}.json").write_text("{}")
    reporter = TelemetryClient(None, None, 1, -1, work_dir / "launcher-spool", 0.05, None)
    report_final_state(reporter, 1, 0, cancelled=False, work_dir=work_dir)
    reporter.close(timeout_s=5)
    (final,) = [event for spooled in read_spool(work_dir / "launcher-spool") for event in spooled["events"]]
    assert final["payload"] == {"attempt": 1, "exit_code": 0, "batches_set_aside": 3, "state": "succeeded"}


def test_the_ingest_operations_schema_resolves_and_names_its_security_scheme(client, platform_user):
    client.force_login(platform_user[0])
    document = client.get("/api/openapi.json").json()

    def refs(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "$ref":
                    yield value
                else:
                    yield from refs(value)
        elif isinstance(node, list):
            for item in node:
                yield from refs(item)

    def resolve(pointer: str):
        assert pointer.startswith("#/"), pointer
        node = document
        for part in pointer[2:].split("/"):
            node = node[part.replace("~1", "/").replace("~0", "~")]
        return node

    for pointer in refs(document):
        resolve(pointer)
    operation = document["paths"]["/api/ingest"]["post"]
    assert operation["security"] == [{"AttemptToken": []}]
    assert document["components"]["securitySchemes"]["AttemptToken"]["scheme"] == "bearer"
    events = operation["requestBody"]["content"]["application/json"]["schema"]["properties"]["events"]
    step = events["items"]["properties"]["step"]
    assert {"type": "integer", "minimum": 0, "maximum": 2**63 - 1} in step["anyOf"]
    assert {"400", "401", "409", "415"} <= set(operation["responses"])


def test_nothing_is_stored_for_any_refused_batch(client, platform_user):
    run, attempt, token = claimed_run(platform_user[0])
    before = Event.objects.count()
    for _, make_body, _ in POISON:
        assert post(client, make_body(attempt.pk, 0), token).status_code == 400
    assert Event.objects.count() == before
    assert not IngestBatch.objects.filter(attempt=attempt).exists()
