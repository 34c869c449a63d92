"""The Experts panel's answer: a mixture-of-experts run's tokens per expert, load imbalance, drops and balance
loss per layer and step, from metric events stored through the real ingest service as the trainer sends them
(one rank per pipeline stage, each with its stage's layers)."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from loom.telemetry.experts import load_imbalance

from .helpers import TINY_CONFIG, BatchSender, claimed_run

pytestmark = pytest.mark.django_db

EXPERTS = 4
# Two pipeline stages of two data-parallel ranks: ranks 0 and 2 send stage 0's layer 0 and stage 1's layer 1.
MOE_CONFIG = {
    **TINY_CONFIG,
    "model": {**TINY_CONFIG["model"], "experts": EXPERTS, "top_k": 2},
    "parallel": {"dp_replicate": 2, "pp": 2, "microbatches": 2},
}
REPORTING = {0: "0", 2: "1"}


def load_of(layer: str, step: int) -> list[int]:
    """Layer 0 routes ever more onto expert 0; layer 1 stays even."""
    if layer == "0":
        return [100 + step, 100, 100, 100]
    return [128, 128, 128, 128]


def metric(rank: int, step: int, **extra) -> dict:
    payload = {"loss_mean": 3.0, "step_time_s": 0.1, **extra}
    layer = REPORTING.get(rank)
    if layer is not None:
        report = {"load": load_of(layer, step), "dropped": step if layer == "0" else 0, "balance_loss": 0.01 * step}
        payload["experts"] = {layer: report}
    return {"kind": "metric", "time": 1000.0 + step, "step": step, "payload": payload}


def send_steps(sender: BatchSender, steps: range, ranks=range(4)) -> None:
    for rank in ranks:
        sender.send(rank, *[metric(rank, step) for step in steps])


@pytest.fixture
def moe_run(platform_user):
    run, attempt, _ = claimed_run(platform_user[0], "moe", MOE_CONFIG)
    return run, BatchSender(attempt)


def experts_answer(client, run, query=""):
    response = client.get(f"/api/runs/{run.pk}/metrics/experts{query}")
    assert response.status_code == 200, response.content
    return response.json()


def test_each_layer_s_load_per_step_comes_from_the_stage_that_holds_it(client, platform_user, moe_run):
    run, sender = moe_run
    send_steps(sender, range(1, 9))
    # Stage 1 is a step behind: step 9 has layer 0's report only.
    send_steps(sender, range(9, 10), ranks=(0, 1))
    client.force_login(platform_user[0])
    answer = experts_answer(client, run)
    run.refresh_from_db()
    assert answer["last_seq"] == run.last_seq
    assert (answer["attempt"], answer["experts"], answer["top_k"]) == (1, EXPERTS, 2)
    assert answer["layers"] == ["0", "1"] and answer["span"] == 1
    assert answer["steps"] == list(range(1, 10))
    assert answer["load"]["0"] == [load_of("0", step) for step in range(1, 10)]
    assert answer["load"]["1"] == [load_of("1", step) for step in range(1, 9)] + [None]
    # Max over mean: step 8 sends 108 of 408 tokens to expert 0, 108 / 102 times its even share.
    assert answer["imbalance"]["0"][7] == pytest.approx(108 / 102)
    assert answer["imbalance"]["1"][:8] == [1.0] * 8 and answer["imbalance"]["1"][8] is None
    assert answer["dropped"]["0"] == list(range(1, 10))
    assert answer["balance_loss"]["1"][:8] == pytest.approx([0.01 * step for step in range(1, 9)])

    only_layer_1 = experts_answer(client, run, "?layers=1&start=3&end=5")
    assert set(only_layer_1["load"]) == {"1"} and only_layer_1["layers"] == ["0", "1"]
    assert only_layer_1["steps"] == [3, 4, 5]


def test_a_long_run_is_summed_into_columns_that_keep_a_one_step_collapse(client, platform_user, moe_run):
    run, sender = moe_run
    collapsed = 1234
    events = [metric(0, step) for step in range(1, 3001)]
    # One step routes all of layer 0's tokens onto expert 3.
    events[collapsed - 1]["payload"]["experts"]["0"]["load"] = [0, 0, 0, 400]
    for first in range(0, len(events), 500):
        sender.send(0, *events[first : first + 500])
    client.force_login(platform_user[0])
    answer = experts_answer(client, run, "?width=100")
    span = answer["span"]
    assert span == 30 and len(answer["steps"]) == 100 and answer["steps"][:2] == [1, 31]
    # Each column sums its steps' tokens per expert, so its shares are its steps' together.
    column = (collapsed - 1) // span
    in_column = range(1 + column * span, 1 + (column + 1) * span)
    expected = [sum(load_of("0", step)[expert] for step in in_column if step != collapsed) for expert in range(4)]
    expected[3] += 400
    assert answer["load"]["0"][column] == expected
    # Its imbalance is its worst step's: everything on one of four experts.
    assert answer["imbalance"]["0"][column] == 4.0
    assert answer["imbalance"]["0"][column + 1] == pytest.approx(load_imbalance(load_of("0", in_column[-1] + span)))
    assert answer["dropped"]["0"][column] == sum(in_column)
    assert answer["balance_loss"]["0"][0] == pytest.approx(0.01 * sum(range(1, 31)) / 30)
    # Stage 1 sent nothing: its layer has a column of nothing wherever layer 0 has one.
    assert answer["load"]["1"] == [None] * 100
    zoomed = experts_answer(client, run, "?width=4000&start=1200&end=1260")
    assert zoomed["span"] == 1 and zoomed["steps"] == list(range(1200, 1261))


def test_an_answer_holds_at_most_its_cells_so_one_layer_gets_finer_columns(client, platform_user):
    """1,024 experts in 2 layers are 2,048 cells a column: an answer of every layer holds 128 columns, one of a
    single layer twice as many."""
    experts, steps = 1024, 130
    config = {**MOE_CONFIG, "model": {**MOE_CONFIG["model"], "experts": experts}}
    run, attempt, _ = claimed_run(platform_user[0], "many experts", config)
    sender = BatchSender(attempt)
    for rank, layer in REPORTING.items():
        report = {"load": [1] * experts, "dropped": 0, "balance_loss": None}
        events = [
            {"kind": "metric", "time": 1000.0 + step, "step": step, "payload": {"experts": {layer: report}}}
            for step in range(1, steps + 1)
        ]
        for first in range(0, steps, 50):
            sender.send(rank, *events[first : first + 50])
    client.force_login(platform_user[0])
    every_layer = experts_answer(client, run, "?width=4000")
    assert every_layer["span"] == 2 and len(every_layer["steps"]) == 65
    assert every_layer["load"]["1"][0] == [2] * experts and every_layer["balance_loss"]["1"][0] is None
    one_layer = experts_answer(client, run, "?width=4000&layers=1")
    assert one_layer["span"] == 1 and len(one_layer["steps"]) == steps


def test_a_dense_run_has_no_layers_and_a_bad_layer_is_refused(client, platform_user, moe_run):
    dense, attempt, _ = claimed_run(platform_user[0], "dense", TINY_CONFIG)
    BatchSender(attempt).send(0, *[{"kind": "metric", "time": 1.0, "step": 1, "payload": {"loss_mean": 3.0}}])
    client.force_login(platform_user[0])
    answer = experts_answer(client, dense)
    assert (answer["experts"], answer["layers"], answer["steps"]) == (1, [], [])
    assert answer["load"] == {} and answer["imbalance"] == {}

    run, sender = moe_run
    send_steps(sender, range(1, 3))
    for query, why in (("?layers=2", "valid choices are ['0', '1']"), ("?layers=first", "comma-separated")):
        refused = client.get(f"/api/runs/{run.pk}/metrics/experts{query}")
        assert refused.status_code == 400 and why in refused.json()["errors"]["layers"]


def test_a_malformed_report_is_left_out_and_the_rest_is_shown(client, platform_user, moe_run):
    run, sender = moe_run
    send_steps(sender, range(1, 3))
    broken = metric(0, 3)
    broken["payload"]["experts"]["0"]["load"] = [1, 2]
    sender.send(0, broken)
    client.force_login(platform_user[0])
    answer = experts_answer(client, run, "?layers=0")
    assert answer["steps"] == [1, 2] and answer["load"]["0"] == [load_of("0", 1), load_of("0", 2)]


def test_another_users_expert_load_is_404(client, platform_user, other_user, moe_run):
    run, sender = moe_run
    send_steps(sender, range(1, 3))
    client.force_login(other_user)
    assert client.get(f"/api/runs/{run.pk}/metrics/experts").status_code == 404


def rows_visited(plan: dict) -> int:
    """Rows of telemetry_event a PostgreSQL plan node and its children visited: those they gave and those
    their filters left out."""
    own = 0
    if plan.get("Relation Name") == "telemetry_event":
        visited = (
            plan["Actual Rows"] + plan.get("Rows Removed by Filter", 0) + plan.get("Rows Removed by Index Recheck", 0)
        )
        own = visited * plan["Actual Loops"]
    return own + sum(rows_visited(child) for child in plan.get("Plans", []))


@pytest.mark.skipif(connection.vendor != "postgresql", reason="reads a PostgreSQL plan; SQLite has no EXPLAIN ANALYZE")
def test_the_answer_reads_the_reporting_ranks_events_not_every_ranks(client, platform_user):
    """At 1,024 ranks one rank per pipeline stage reports expert load: the answer must not read every rank's
    metric events to find those."""
    ranks, steps = 64, 200
    config = {**MOE_CONFIG, "parallel": {"dp_replicate": ranks}}
    run, attempt, _ = claimed_run(platform_user[0], "wide moe", config)
    # By SQL: the ingest path would take a minute for 12,800 events. ANALYZE as autovacuum would.
    with connection.cursor() as cursor:
        cursor.execute(
            """INSERT INTO telemetry_event (run_id, seq, attempt_id, kind, rank, step, payload, time, received_at)
               SELECT %s, s * %s + r, %s, 'metric', r, s,
                   CASE WHEN r = 0 THEN jsonb_build_object('experts', jsonb_build_object(
                       '0', jsonb_build_object('load', jsonb_build_array(s, 1, 1, 1), 'dropped', 0),
                       '1', jsonb_build_object('load', jsonb_build_array(1, s, 1, 1), 'dropped', 0)))
                   ELSE jsonb_build_object('loss_mean', 3.0) END,
                   now(), now()
               FROM generate_series(1, %s) AS s, generate_series(0, %s - 1) AS r""",
            [run.pk, ranks, attempt.pk, steps, ranks],
        )
        cursor.execute("ANALYZE telemetry_event")
    client.force_login(platform_user[0])
    with CaptureQueriesContext(connection) as queries:
        answer = experts_answer(client, run)
    assert answer["steps"] == list(range(1, steps + 1)) and answer["load"]["1"][-1] == [1, steps, 1, 1]
    reads = [query["sql"] for query in queries if "telemetry_event" in query["sql"]]
    assert reads
    read = 0
    with connection.cursor() as cursor:
        for sql in reads:
            cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}")
            read += rows_visited(cursor.fetchone()[0][0]["Plan"])
    # The step bounds (two index lookups) and the reporting rank's events.
    assert read <= steps + 2, read
