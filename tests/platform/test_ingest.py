import json
import threading

import pytest
from django.db import connection
from django.test import Client

from loom.runs import states
from loom.telemetry.models import Event, IngestBatch

from .helpers import TINY_CONFIG, batch, claimed_run, event_count

pytestmark = pytest.mark.django_db


def post(client: Client, body, token: str | None, **extra):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return client.post("/api/ingest", data=data, content_type="application/json", **headers, **extra)


def test_batch_is_stored_with_increasing_seq(client, platform_user):
    run, attempt, token = claimed_run(platform_user[0])
    response = post(client, batch(attempt, steps=(1, 2, 3)), token)
    assert response.status_code == 200
    assert response.json() == {"stored": 3, "duplicate": False}
    metrics = list(run.events.filter(kind="metric").order_by("seq"))
    assert [e.step for e in metrics] == [1, 2, 3]
    seqs = list(run.events.order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(1, len(seqs) + 1))


def test_same_batch_twice_is_stored_once(client, platform_user):
    run, attempt, token = claimed_run(platform_user[0])
    first = post(client, batch(attempt, rank=1, seq=7), token)
    second = post(client, batch(attempt, rank=1, seq=7), token)
    assert first.json()["duplicate"] is False
    assert second.status_code == 200 and second.json() == {"stored": 0, "duplicate": True}
    assert event_count(run, kind="metric") == 3
    assert IngestBatch.objects.filter(attempt=attempt).count() == 1


def test_same_seq_from_another_rank_is_a_different_batch(client, platform_user):
    run, attempt, token = claimed_run(platform_user[0])
    post(client, batch(attempt, rank=0, seq=0), token)
    post(client, batch(attempt, rank=1, seq=0), token)
    assert event_count(run, kind="metric", rank=0) == 3
    assert event_count(run, kind="metric", rank=1) == 3


def test_unknown_or_missing_token_is_401_and_stores_nothing(client, platform_user):
    run, attempt, _ = claimed_run(platform_user[0])
    before = Event.objects.count()
    assert post(client, batch(attempt), "attempt_not-a-real-token").status_code == 401
    assert post(client, batch(attempt), None).status_code == 401
    assert Event.objects.count() == before


def test_token_of_another_attempt_is_403_and_stores_nothing(client, platform_user, other_user):
    _, mine, my_token = claimed_run(platform_user[0], "mine")
    theirs_run, theirs, _ = claimed_run(other_user, "theirs")
    before = event_count(theirs_run)
    response = post(client, batch(theirs), my_token)
    assert response.status_code == 403
    assert event_count(theirs_run) == before
    assert not IngestBatch.objects.filter(attempt=theirs).exists()


def test_oversized_batch_is_413_and_stores_nothing(client, platform_user, settings):
    run, attempt, token = claimed_run(platform_user[0])
    before = event_count(run)
    huge = batch(attempt, steps=range(1, 10))
    huge["events"][0]["payload"]["blob"] = "x" * (settings.LOOM_INGEST_MAX_BYTES + 1)
    assert post(client, huge, token).status_code == 413
    too_many = batch(attempt, seq=1, steps=range(settings.LOOM_INGEST_MAX_EVENTS + 1))
    assert post(client, too_many, token).status_code == 413
    assert event_count(run) == before
    assert not IngestBatch.objects.filter(attempt=attempt).exists()


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda b: b["events"][0].update(kind="gossip"), "events.0.kind"),
        (lambda b: b.pop("seq"), "seq"),
        (lambda b: b.update(rank=-5), "rank"),
        (lambda b: b["events"][0].update(time="yesterday"), "events.0.time"),
    ],
)
def test_malformed_batch_is_400_with_field_errors(client, platform_user, mutate, field):
    run, attempt, token = claimed_run(platform_user[0])
    before = event_count(run)
    body = batch(attempt)
    mutate(body)
    response = post(client, body, token)
    assert response.status_code == 400
    assert field in response.json()["errors"]
    assert event_count(run) == before


def test_non_json_body_is_400(client, platform_user):
    _, _, token = claimed_run(platform_user[0])
    assert post(client, "{not json", token).status_code == 400


def test_launcher_state_events_move_the_attempt_and_run(client, platform_user):
    run, attempt, token = claimed_run(platform_user[0])
    state_batch = {
        "attempt": attempt.pk,
        "rank": -1,
        "seq": 0,
        "events": [
            {"kind": "state", "time": 1.0, "payload": {"state": states.STARTING}},
            {"kind": "state", "time": 2.0, "payload": {"state": states.RUNNING, "pid": 123}},
            {"kind": "state", "time": 3.0, "payload": {"state": states.FAILED, "exit_code": 1, "reason": "boom"}},
        ],
    }
    assert post(client, state_batch, token).status_code == 200
    attempt.refresh_from_db()
    run.refresh_from_db()
    assert (attempt.state, attempt.exit_code, attempt.failure_reason) == (states.FAILED, 1, "boom")
    assert attempt.started_at is not None and attempt.finished_at is not None
    assert run.state == states.FAILED


def test_illegal_launcher_state_is_stored_but_does_not_move_the_attempt(client, platform_user):
    run, attempt, token = claimed_run(platform_user[0])
    body = {"attempt": attempt.pk, "rank": -1, "seq": 0,
            "events": [{"kind": "state", "time": 1.0, "payload": {"state": states.SUCCEEDED}}]}  # fmt: skip
    assert post(client, body, token).status_code == 200
    attempt.refresh_from_db()
    assert attempt.state == states.STARTING
    assert event_count(run, kind="state", rank=-1) == 1


@pytest.mark.django_db(transaction=True)
def test_concurrent_batches_from_many_ranks_are_each_stored_once(platform_user):
    ranks, batches_per_rank = 8, 5
    run, attempt, token = claimed_run(platform_user[0], config=TINY_CONFIG | {"parallel": {"dp_replicate": ranks}})
    errors = []

    def send(rank):
        client = Client()
        try:
            for seq in range(batches_per_rank):
                for _ in range(2):  # every batch is retried once
                    response = post(client, batch(attempt, rank=rank, seq=seq, steps=(seq * 2 + 1, seq * 2 + 2)), token)
                    if response.status_code != 200:
                        errors.append(response.status_code)
        finally:
            connection.close()

    threads = [threading.Thread(target=send, args=(rank,)) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert event_count(run, kind="metric") == ranks * batches_per_rank * 2
    for rank in range(ranks):
        steps = sorted(run.events.filter(kind="metric", rank=rank).values_list("step", flat=True))
        assert steps == list(range(1, batches_per_rank * 2 + 1))
    seqs = list(run.events.order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(1, len(seqs) + 1))


def test_bare_nan_and_infinity_are_stored_as_the_strings_the_trainer_sends(client, platform_user):
    run, attempt, token = claimed_run(platform_user[0])
    # What Python's json.dumps writes for these by default: not JSON, but common.
    payload = '{"loss": NaN, "grad_norm": Infinity, "lr": -Infinity}'
    event = f'{{"kind": "metric", "time": 1.0, "payload": {payload}}}'
    body = f'{{"attempt": {attempt.pk}, "rank": 0, "seq": 0, "events": [{event}]}}'
    response = post(client, body, token)
    assert response.status_code == 200, response.content
    stored = run.events.get(kind="metric").payload
    assert stored == {"loss": "NaN", "grad_norm": "Infinity", "lr": "-Infinity"}


def test_a_non_finite_event_time_is_a_field_error(client, platform_user):
    run, attempt, token = claimed_run(platform_user[0])
    body = '{"attempt": %d, "rank": 0, "seq": 0, "events": [{"kind": "metric", "time": NaN, "payload": {}}]}'
    response = post(client, body % attempt.pk, token)
    assert response.status_code == 400 and "events.0.time" in response.json()["errors"]
    assert run.events.filter(kind="metric").count() == 0
