"""What the run page's charts read: downsampled series, per-rank lines and bands, the rank × step heatmap
and the communication matrix, built from events stored through the real ingest service."""

import random

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from loom.telemetry.downsample import bucket_width, min_max

from .helpers import TINY_CONFIG, BatchSender, claimed_run

pytestmark = pytest.mark.django_db


def metric(step, rank, step_time=0.1, **payload):
    payload = {"loss_mean": 3.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 100.0, "mfu": 0.3,
               "step_time_s": step_time, "memory_rss": 1000 + rank, **payload}  # fmt: skip
    return {"kind": "metric", "time": 1000.0 + step, "step": step, "payload": payload}


def send_steps(sender, ranks, steps, overrides=None, per_batch=100):
    """overrides: (rank, step) → payload fields for that point."""
    for rank in ranks:
        for first in range(steps.start, steps.stop, per_batch):
            chunk = range(first, min(first + per_batch, steps.stop))
            sender.send(rank, *[metric(s, rank, **(overrides or {}).get((rank, s), {})) for s in chunk])


def world_config(ranks):
    return {**TINY_CONFIG, "parallel": {"dp_replicate": ranks}}


@pytest.mark.parametrize("seed", range(5))
def test_downsampling_keeps_every_buckets_extremes(seed):
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(1, 50_000), 7_000))
    values = [rng.gauss(0, 1) for _ in steps]
    values[rng.randrange(len(values))] = 40.0  # one spike
    buckets = 150
    kept_steps, kept_values = min_max(steps, values, buckets)
    assert len(kept_steps) <= 4 * buckets and kept_steps == sorted(kept_steps)
    assert max(kept_values) == 40.0
    width = bucket_width(steps[0], steps[-1], buckets)
    original = {step: value for step, value in zip(steps, values, strict=True)}
    for bucket in {(s - steps[0]) // width for s in steps}:
        inside = [original[s] for s in steps if (s - steps[0]) // width == bucket]
        kept = [v for s, v in zip(kept_steps, kept_values, strict=True) if (s - steps[0]) // width == bucket]
        assert (min(kept), max(kept)) == (min(inside), max(inside))
        assert all(original[s] == v for s, v in zip(kept_steps, kept_values, strict=True))


def test_series_are_downsampled_per_attempt_and_keep_a_loss_spike(client, platform_user):
    user = platform_user[0]
    run, attempt, _ = claimed_run(user, config=world_config(2))
    send_steps(BatchSender(attempt), range(2), range(1, 3001), {(0, 1234): {"loss_mean": 90.0}})
    client.force_login(user)
    answer = client.get(f"/api/runs/{run.pk}/metrics/series?width=200").json()
    run.refresh_from_db()
    assert answer["last_seq"] == run.last_seq
    (only,) = answer["attempts"]
    assert (only["attempt"], only["world_size"], only["data_parallel"]) == (1, 2, 2)
    loss = only["series"]["loss_mean"]
    assert len(loss["step"]) <= 400 and 1234 in loss["step"] and max(loss["value"]) == 90.0
    assert set(only["series"]["tokens_per_s"]["value"]) == {200.0}
    zoomed = client.get(f"/api/runs/{run.pk}/metrics/series?width=200&start=1200&end=1260").json()
    assert zoomed["attempts"][0]["series"]["lr"]["step"] == list(range(1200, 1261))


def test_few_ranks_are_lines_and_many_ranks_a_band_with_the_spike_in_max(client, platform_user):
    user = platform_user[0]
    client.force_login(user)
    small, small_attempt, _ = claimed_run(user, "small", world_config(2))
    send_steps(BatchSender(small_attempt), range(2), range(1, 41))
    lines = client.get(f"/api/runs/{small.pk}/metrics/ranks?metric=memory_bytes").json()
    assert lines["span"] == 1 and set(lines["lines"]) == {"0", "1"}
    assert lines["lines"]["1"]["mean"] == [1001] * 40

    big, attempt, _ = claimed_run(user, "big", world_config(16))
    send_steps(BatchSender(attempt), range(16), range(1, 2001), {(5, 777): {"step_time_s": 9.0}})
    band = client.get(f"/api/runs/{big.pk}/metrics/ranks?metric=step_time_s&width=200").json()
    assert "lines" not in band and band["span"] == 64 and band["world_size"] == 16
    spike = band["band"]["step"].index(777 // 64 * 64)
    assert band["band"]["max"][spike] == 9.0 and band["band"]["median"][spike] == pytest.approx(0.1)
    lows, middles, highs = (band["band"][k] for k in ("min", "median", "max"))
    # A mean of 64 equal float steps can differ from them in the last bit.
    assert all(lo - 1e-12 <= mid <= hi + 1e-12 for lo, mid, hi in zip(lows, middles, highs, strict=True))
    picked = client.get(f"/api/runs/{big.pk}/metrics/ranks?ranks=5,6&start=770&end=790").json()
    assert picked["span"] == 1 and set(picked["lines"]) == {"5", "6"}
    assert picked["lines"]["5"]["max"][777 - 770] == 9.0
    assert client.get(f"/api/runs/{big.pk}/metrics/ranks?ranks=99").status_code == 400
    assert "metric" in client.get(f"/api/runs/{big.pk}/metrics/ranks?metric=rss").json()["errors"]


def test_a_band_s_middle_is_the_median_over_ranks_from_tiles_and_from_raw_steps(client, platform_user):
    """The database groups the band (percentile_cont on PostgreSQL, a registered aggregate on SQLite):
    with 10 ranks the middle is the mean of the 5th and 6th rank, not the mean over ranks."""
    user = platform_user[0]
    client.force_login(user)
    run, attempt, _ = claimed_run(user, config=world_config(10))
    times = {(rank, step): {"step_time_s": (rank + 1) ** 2 / 100} for rank in range(10) for step in range(1, 201)}
    send_steps(BatchSender(attempt), range(10), range(1, 201), times)
    tiled = client.get(f"/api/runs/{run.pk}/metrics/ranks?metric=step_time_s&width=200").json()
    raw = client.get(f"/api/runs/{run.pk}/metrics/ranks?metric=step_time_s&start=50&end=60").json()
    assert tiled["span"] == 8 and tiled["band"]["step"] == list(range(0, 201, 8))
    assert raw["span"] == 1 and raw["band"]["step"] == list(range(50, 61))
    for band in (tiled["band"], raw["band"]):
        assert band["median"] == pytest.approx([(0.25 + 0.36) / 2] * len(band["step"]))
        assert band["min"] == pytest.approx([0.01] * len(band["step"]))
        assert band["max"] == pytest.approx([1.0] * len(band["step"]))
    memory = client.get(f"/api/runs/{run.pk}/metrics/ranks?metric=memory_bytes&start=1&end=3").json()["band"]
    assert memory == {"step": [1, 2, 3], "min": [1000] * 3, "median": [1004.5] * 3, "max": [1009] * 3}


def test_the_heatmap_shows_a_slow_rank_as_a_stripe_and_names_its_host(client, platform_user):
    user = platform_user[0]
    run, attempt, _ = claimed_run(user, config=world_config(8))
    sender = BatchSender(attempt)
    slow = {(3, step): {"step_time_s": 0.4} for step in range(1, 601)}
    send_steps(sender, range(8), range(1, 601), slow)
    for rank in range(8):
        sender.send(rank, {"kind": "heartbeat", "time": 1.0, "step": 600, "payload": {"host": f"node-{rank // 4}"}})
    client.force_login(user)
    heat = client.get(f"/api/runs/{run.pk}/metrics/heatmap?width=100").json()
    assert heat["span"] == 8 and heat["ranks"] == list(range(8))
    assert heat["hosts"] == ["node-0"] * 4 + ["node-1"] * 4
    means = [sum(row) / len(row) for row in heat["z"]]
    assert max(range(8), key=means.__getitem__) == 3 and means[3] == pytest.approx(0.4)
    fine = client.get(f"/api/runs/{run.pk}/metrics/heatmap?width=100&start=10&end=60").json()
    assert fine["span"] == 1 and fine["steps"] == list(range(10, 61))

    # A page following the run asks for its last bucket onwards at the span it shows: the same buckets.
    tail = client.get(f"/api/runs/{run.pk}/metrics/heatmap?width=100&start=592&span=8").json()
    assert tail["span"] == 8 and tail["steps"] == [592, 600]
    assert [row[-2:] for row in heat["z"]] == tail["z"]
    for span, field in ((5, "span"), (1, "span")):
        refused = client.get(f"/api/runs/{run.pk}/metrics/heatmap?width=100&span={span}")
        assert refused.status_code == 400 and field in refused.json()["errors"]


def test_comm_matrix_per_step_with_kinds_beside_the_prediction(client, platform_user):
    user = platform_user[0]
    config = {**TINY_CONFIG, "parallel": {"dp_replicate": 2, "tp": 2}}
    run, attempt, _ = claimed_run(user, config=config)
    sender = BatchSender(attempt)
    for window in ([1, 5], [6, 10]):
        for rank in range(4):
            sends = [[rank ^ 1, 1000, "tp", 10], [rank ^ 2, 100, "dp", 1], [rank ^ 1, 300, "pp", 1]]
            payload = {"rank": rank, "window": window, "world_size": 4, "sends": sends, "time_s": 0.1}
            sender.send(rank, {"kind": "comm", "time": 1.0, "step": window[1], "payload": payload})
    client.force_login(user)
    answer = client.get(f"/api/runs/{run.pk}/comm").json()
    assert answer["windows"] == [[1, 5], [6, 10]] and answer["window"] == [6, 10] and answer["steps"] == 5
    measured = answer["measured"]
    assert measured["bytes"][0][1] == 260 and measured["bytes"][0][2] == 20 and measured["bytes"][0][3] == 0
    assert measured["kind"][0][1] == "tp" and measured["kind"][0][2] == "dp" and measured["kind"][0][3] == ""
    # Each kind's own share of a cell, also where another kind carries more of it.
    assert sorted(measured["by_kind"]) == ["dp", "pp", "tp"]
    assert [0, 1, 60] in measured["by_kind"]["pp"] and [0, 1, 200] in measured["by_kind"]["tp"]
    assert len(measured["by_kind"]["pp"]) == 4 and not any(cell[:2] == [0, 2] for cell in measured["by_kind"]["pp"])
    both = client.get(f"/api/runs/{run.pk}/comm?start=1&end=10").json()
    assert both["steps"] == 10 and both["measured"]["bytes"][2][3] == 260
    predicted = answer["predicted"]
    assert predicted["kind"][0][1] == "tp" and predicted["kind"][0][2] == "dp" and predicted["bytes"][0][3] == 0


def rows_read(plan: dict) -> int:
    """Rows the scans of an EXPLAIN ANALYZE plan read from telemetry_event, over all their loops."""
    own = plan["Actual Rows"] * plan["Actual Loops"] if plan.get("Relation Name") == "telemetry_event" else 0
    return own + sum(rows_read(child) for child in plan.get("Plans", []))


@pytest.mark.skipif(connection.vendor != "postgresql", reason="reads a PostgreSQL plan; SQLite has no EXPLAIN ANALYZE")
def test_listing_the_traffic_windows_reads_one_ranks_comm_events_not_every_ranks(client, platform_user):
    """At 1,024 ranks × 10,000 steps an attempt holds a million comm events; the traffic panel lists the
    windows from the lowest rank's alone (it read all of them: a second per answer)."""
    user = platform_user[0]
    run, attempt, _ = claimed_run(user, config=world_config(64))
    windows, ranks = 300, 64
    # By SQL: the ingest path would take a minute for 19,200 events. ANALYZE as autovacuum would.
    with connection.cursor() as cursor:
        cursor.execute(
            """INSERT INTO telemetry_event (run_id, seq, attempt_id, kind, rank, step, payload, time, received_at)
               SELECT %s, 1000 + w * %s + r, %s, 'comm', r, w * 10,
                   jsonb_build_object('rank', r, 'window', jsonb_build_array(w * 10 - 9, w * 10), 'sends', '[]'::jsonb),
                   now(), now()
               FROM generate_series(1, %s) AS w, generate_series(0, %s - 1) AS r""",
            [run.pk, ranks, attempt.pk, windows, ranks],
        )
        cursor.execute("ANALYZE telemetry_event")
    client.force_login(user)
    with CaptureQueriesContext(connection) as queries:
        answer = client.get(f"/api/runs/{run.pk}/comm").json()
    assert len(answer["windows"]) == windows and answer["windows"][-1] == [2991, 3000] and answer["steps"] == 10
    comm_reads = [query["sql"] for query in queries if "telemetry_event" in query["sql"]]
    assert comm_reads
    read = 0
    with connection.cursor() as cursor:
        for sql in comm_reads:
            cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}")
            read += rows_read(cursor.fetchone()[0][0]["Plan"])
    # One rank's windows, one lowest-rank lookup and the chosen window's row of every rank.
    assert read <= windows + 1 + ranks, read


def test_events_can_be_read_by_kind_up_to_a_seq(client, platform_user):
    user = platform_user[0]
    run, attempt, _ = claimed_run(user)
    sender = BatchSender(attempt)
    send_steps(sender, [0], range(1, 4))
    sender.send(0, {"kind": "log", "time": 1.0, "step": 3, "payload": {"message": "hello"}})
    send_steps(sender, [0], range(4, 6))
    client.force_login(user)
    logs = client.get(f"/api/runs/{run.pk}/events?kinds=log,state").json()
    assert [event["kind"] for event in logs["events"]].count("log") == 1 and logs["more"] is False
    until = logs["events"][-1]["seq"]
    before = client.get(f"/api/runs/{run.pk}/events?until={until - 1}&kinds=metric&limit=2").json()
    assert [event["step"] for event in before["events"]] == [1, 2] and before["more"] is True
    refused = client.get(f"/api/runs/{run.pk}/events?kinds=gossip")
    assert refused.status_code == 400 and "kinds" in refused.json()["errors"]


def test_another_users_charts_are_404(client, platform_user, other_user):
    run, _, _ = claimed_run(platform_user[0])
    client.force_login(other_user)
    for path in ("metrics/series", "metrics/ranks", "metrics/heatmap", "comm"):
        assert client.get(f"/api/runs/{run.pk}/{path}").status_code == 404
