"""Ingest as the platform serves it: the ASGI endpoint with its group commit, and the tables the charts
read (RankStep, RankTile, RankStatus) filled from the stored events."""

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from loom.telemetry import writer as writer_module
from loom.telemetry.models import Event, IngestBatch, RankStatus, RankStep, RankTile
from loom.telemetry.store import TILE_SPANS, IngestResult, PendingBatch
from loom.telemetry.writer import IngestWriter, WriterBusy

from .helpers import BatchSender, claimed_run


def post(url: str, body, token: str | None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(f"{url}/api/ingest", data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def metric(step: int, step_time: float, memory: int, **extra) -> dict:
    payload = {"loss_mean": 4.0 - step / 100, "step_time_s": step_time, "memory_rss": memory, **extra}
    return {"kind": "metric", "time": time.time(), "step": step, "payload": payload}


@pytest.mark.django_db(transaction=True)
def test_the_endpoint_answers_each_rule_as_the_api_documents(platform_server, platform_user, other_user, settings):
    run, attempt, token = claimed_run(platform_user[0])
    _, theirs, _ = claimed_run(other_user, "theirs")
    body = {"attempt": attempt.pk, "rank": 0, "seq": 0, "events": [metric(1, 0.2, 1000)]}
    assert post(platform_server.url, body, token) == (200, {"stored": 1, "duplicate": False})
    assert post(platform_server.url, body, token) == (200, {"stored": 0, "duplicate": True})
    assert post(platform_server.url, body, "attempt_unknown")[0] == 401
    assert post(platform_server.url, body, None)[0] == 401
    assert post(platform_server.url, {**body, "attempt": theirs.pk, "seq": 1}, token)[0] == 403
    assert post(platform_server.url, b"{not json", token)[0] == 400
    status, answer = post(platform_server.url, {**body, "seq": 2, "rank": -7}, token)
    assert status == 400 and "rank" in answer["errors"]
    huge = {**body, "seq": 3, "events": [metric(2, 0.2, 1, blob="x" * 4 * settings.LOOM_INGEST_MAX_BYTES)]}
    assert post(platform_server.url, huge, token)[0] == 413
    assert run.events.filter(kind="metric").count() == 1
    assert IngestBatch.objects.filter(attempt=attempt).count() == 1


@pytest.mark.django_db(transaction=True)
def test_many_ranks_posting_at_once_with_retries_store_every_event_once(platform_server, platform_user):
    run, attempt, token = claimed_run(platform_user[0])
    ranks, batches_per_rank, steps_per_batch = 32, 6, 2
    # An attempt of 32 ranks, more than this host launches: its ranks are only simulated here.
    attempt.config["parallel"] = {"dp_replicate": ranks}
    attempt.save(update_fields=["config"])
    failures = []

    def send_into(answers, body):
        answers.append(post(platform_server.url, body, token))

    def rank_sends(rank):
        for seq in range(batches_per_rank):
            steps = range(seq * steps_per_batch + 1, (seq + 1) * steps_per_batch + 1)
            body = {"attempt": attempt.pk, "rank": rank, "seq": seq, "events": [metric(s, 0.1, 1) for s in steps]}
            # Each batch goes twice at the same moment: a client retry racing its original.
            answers = []
            racers = [threading.Thread(target=send_into, args=(answers, body)) for _ in range(2)]
            for racer in racers:
                racer.start()
            for racer in racers:
                racer.join()
            if sorted(a[1]["duplicate"] for a in answers if a[0] == 200) != [False, True]:
                failures.append((rank, seq, answers))

    threads = [threading.Thread(target=rank_sends, args=(rank,)) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    sent = ranks * batches_per_rank * steps_per_batch
    assert run.events.filter(kind="metric").count() == sent
    seqs = list(run.events.order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(1, len(seqs) + 1))
    run.refresh_from_db()
    assert run.last_seq == seqs[-1]
    assert RankStep.objects.filter(attempt=attempt).count() == sent
    for rank in (0, ranks - 1):
        steps = RankStep.objects.filter(attempt=attempt, rank=rank).order_by("step").values_list("step", flat=True)
        assert list(steps) == list(range(1, batches_per_rank * steps_per_batch + 1))


@pytest.mark.django_db
def test_metrics_become_rank_steps_and_tiles_that_keep_sums_and_extremes(platform_user):
    run, attempt, _ = claimed_run(platform_user[0])
    sender = BatchSender(attempt)
    # Rank 1 is slow at step 70, and its batches arrive in two transactions for the same tiles.
    times = {step: (0.9 if step == 70 else 0.1 + step / 1000) for step in range(60, 80)}
    # Own work (the step minus its collectives) where the recorder reported it: even steps only.
    compute = {step: times[step] / 2 for step in times if step % 2 == 0}

    def rank_1(step: int) -> dict:
        extra = {"compute_s": compute[step]} if step in compute else {}
        return metric(step, times[step], 1000 + step, **extra)

    sender.send(1, *[rank_1(step) for step in range(60, 70)])
    sender.send(1, *[rank_1(step) for step in range(70, 80)])
    sender.send(0, metric(60, 0.5, 7, loss="NaN", mfu=0.4))

    row = RankStep.objects.get(attempt=attempt, rank=0, step=60)
    assert (row.loss, row.mfu, row.step_time_s, row.memory_bytes, row.compute_s) == (None, 0.4, 0.5, 7, None)
    assert RankStep.objects.get(attempt=attempt, rank=1, step=70).compute_s == pytest.approx(0.45)
    assert row.loss_mean == pytest.approx(3.4)
    assert RankStep.objects.filter(attempt=attempt, rank=1).count() == 20

    for span in TILE_SPANS:
        tiles = RankTile.objects.filter(attempt=attempt, span=span, rank=1)
        assert sum(tile.count for tile in tiles) == 20
        for tile in tiles:
            steps = [s for s in times if s // span == tile.bucket]
            assert tile.count == len(steps)
            assert tile.step_time_sum == pytest.approx(sum(times[s] for s in steps))
            assert tile.step_time_max == pytest.approx(max(times[s] for s in steps))
            assert tile.step_time_min == pytest.approx(min(times[s] for s in steps))
            assert (tile.memory_min, tile.memory_max) == (1000 + min(steps), 1000 + max(steps))
            assert tile.compute_sum == pytest.approx(sum(compute[s] for s in steps if s in compute))
            assert tile.compute_max == pytest.approx(max(compute[s] for s in steps if s in compute))
    (spike,) = RankTile.objects.filter(attempt=attempt, span=8, rank=1, bucket=70 // 8)
    assert spike.step_time_max == pytest.approx(0.9)


@pytest.mark.django_db
def test_heartbeats_keep_each_ranks_host_and_latest_beat(platform_user):
    _, attempt, _ = claimed_run(platform_user[0])
    sender = BatchSender(attempt)
    beat = {"kind": "heartbeat", "payload": {"host": "node-a", "pid": 11}}
    sender.send(0, {**beat, "time": 100.0, "step": 3}, {**beat, "time": 101.0, "step": 4})
    sender.send(1, {**beat, "time": 100.5, "step": None, "payload": {"host": "node-b", "pid": 12}})
    sender.send(0, {**beat, "time": 102.0, "step": None})
    status = {s.rank: s for s in RankStatus.objects.filter(attempt=attempt)}
    assert (status[0].host, status[0].pid, status[0].last_step, status[0].last_heartbeat.timestamp()) == (
        "node-a",
        11,
        4,
        102.0,
    )
    assert (status[1].host, status[1].last_step) == ("node-b", None)


@pytest.mark.django_db(transaction=True)
def test_a_batch_that_cannot_be_stored_fails_alone_and_the_rest_commit(platform_user):
    _, attempt, _ = claimed_run(platform_user[0])
    writer = IngestWriter()
    good = [PendingBatch(attempt.pk, 1, attempt.run_id, rank, 0, [metric(1, 0.1, 1)]) for rank in range(3)]
    orphan = PendingBatch(attempt.pk + 10_000, 1, attempt.run_id, 0, 0, [metric(1, 0.1, 1)])
    futures = [writer.submit(batch) for batch in (good[0], orphan, good[1], good[2])]
    results = []
    for future in futures:
        try:
            results.append(future.result(timeout=30).stored)
        except Exception as error:
            results.append(type(error).__name__)
    assert results[0] == results[2] == results[3] == 1
    assert results[1] == "IntegrityError"
    assert Event.objects.filter(attempt=attempt, kind="metric").count() == 3


def test_a_full_writer_refuses_at_once_instead_of_queueing_without_bound():
    writer = IngestWriter(max_waiting=0)
    with pytest.raises(WriterBusy):
        writer.submit(PendingBatch(1, 1, 1, 0, 0, []))


def test_requests_on_an_event_loop_are_answered_with_one_call_into_it_per_transaction():
    """The first transaction holds batch 0 while 19 more queue; they are written together and their 19
    requests answered by one call into the loop. A batch that fails fails alone, as with submit()."""
    first_started, release = threading.Event(), threading.Event()
    transactions = []

    def store(batches):
        transactions.append([batch.seq for batch in batches])
        if len(transactions) == 1:
            first_started.set()
            release.wait(10)
        if any(batch.seq == 13 for batch in batches):
            raise ValueError("batch 13 is refused")
        return [IngestResult(stored=len(batch.events), duplicate=False) for batch in batches]

    writer = IngestWriter(store=store)
    batches = [PendingBatch(1, 1, 1, 0, seq, [{"seq": seq}] * (seq % 3)) for seq in range(20)]

    async def post_all():
        loop = asyncio.get_running_loop()
        settles = []
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            if callback is writer_module._settle_on_loop:
                settles.append(len(args[0]))
            return call_soon_threadsafe(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted
        futures = [writer.submit_from_loop(batches[0])]
        assert await asyncio.to_thread(first_started.wait, 10)
        futures += [writer.submit_from_loop(batch) for batch in batches[1:]]
        release.set()
        outcomes = await asyncio.gather(*futures, return_exceptions=True)
        return outcomes, settles

    outcomes, settles = asyncio.run(post_all())
    # Together (refused for batch 13), then each of the 19 alone.
    assert transactions[:2] == [[0], list(range(1, 20))] and len(transactions) == 2 + 19
    assert settles == [1, 19]
    assert [outcome.stored for seq, outcome in enumerate(outcomes) if seq != 13] == [
        seq % 3 for seq in range(20) if seq != 13
    ]
    assert isinstance(outcomes[13], ValueError)
