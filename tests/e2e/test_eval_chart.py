"""Validation loss on the pages, in real headless Chromium against the real platform: metric events carrying
eval_loss posted through the real ingest API (HTTP, the attempt's own token) appear as a line of their own on
the run page's loss chart (from the snapshot and live), on the comparison page and in both pages' CSVs."""

import csv
import io
import time

import pytest

from ..platform.helpers import TINY_CONFIG, claimed_run
from .test_run_panels import VIEWPORT, Ingest, chart_data, launcher_running, open_run, wait_for_chart

pytestmark = pytest.mark.e2e

RANKS = 2
STEPS = 40
INTERVAL = 10
EVALUATING = {**TINY_CONFIG, "steps": 100, "eval": {"interval_steps": INTERVAL}}
VALIDATION = "validation, attempt 1"


def train_loss(step: int) -> float:
    return 5.0 - step / 20


def eval_loss(step: int) -> float:
    return 4.5 - step / 40


def metric(step: int, at: float) -> dict:
    payload = {"loss": train_loss(step), "loss_mean": train_loss(step), "grad_norm": 1.0, "step_time_s": 0.1}
    if step % INTERVAL == 0:
        payload["eval_loss"] = eval_loss(step)
    return {"kind": "metric", "time": at, "step": step, "payload": payload}


def post_steps(ingest: Ingest, steps: range, start: float) -> None:
    for rank in range(RANKS):
        ingest.post(rank, [metric(step, start + step) for step in steps])


@pytest.fixture
def evaluating_run(platform_user, platform_server):
    """A running 2-rank run that has reported STEPS steps, evaluated every INTERVAL; returns (run, Ingest, start)."""
    run, attempt, token = claimed_run(platform_user[0], "evaluating", EVALUATING)
    ingest = Ingest(f"{platform_server.url}/api/ingest", attempt, token)
    start = time.time() - STEPS - 10
    ingest.post(-1, [launcher_running(attempt, start)])
    post_steps(ingest, range(1, STEPS + 1), start)
    return run, ingest, start


@pytest.fixture
def unevaluated_run(platform_user, evaluating_run):
    """A run of the same platform that reported three steps and never evaluates."""
    run, attempt, token = claimed_run(platform_user[0], "no eval", TINY_CONFIG)
    Ingest(evaluating_run[1].url, attempt, token).post(0, [metric(step, time.time()) for step in (1, 2, 3)])
    return run


def downloaded_rows(page, chart_id: str, filename: str) -> list[list[str]]:
    with page.expect_download() as download:
        page.click(f".chart-card:has(#{chart_id}) .csv-button")
    assert download.value.suggested_filename == filename
    return list(csv.reader(io.StringIO(open(download.value.path()).read())))


def test_validation_loss_is_its_own_line_on_the_run_pages_loss_chart_live_and_in_its_csv(
    evaluating_run, open_logged_in
):
    run, ingest, start = evaluating_run
    errors = []
    page = open_run(open_logged_in, run.pk, errors)
    wait_for_chart(page, "loss-chart", "data.length === 2")
    traces = {trace["name"]: trace for trace in chart_data(page, "loss-chart")}
    assert set(traces) == {"attempt 1", VALIDATION}
    assert traces["attempt 1"]["x"] == list(range(1, STEPS + 1))
    evaluated = list(range(INTERVAL, STEPS + 1, INTERVAL))
    assert traces[VALIDATION]["x"] == evaluated
    assert traces[VALIDATION]["y"] == pytest.approx([eval_loss(step) for step in evaluated])
    style = page.evaluate(
        "() => document.getElementById('loss-chart').data.map((trace) => [trace.name, trace.line.dash, trace.mode])"
    )
    assert sorted(style) == [["attempt 1", "solid", "lines"], [VALIDATION, "dash", "lines+markers"]]

    # The next evaluation arrives over the websocket and extends the validation line only.
    post_steps(ingest, range(STEPS + 1, STEPS + INTERVAL + 1), start)
    wait_for_chart(
        page, "loss-chart", f"data.some((t) => t.name === '{VALIDATION}' && t.x.includes({STEPS + INTERVAL}))"
    )
    traces = {trace["name"]: trace for trace in chart_data(page, "loss-chart")}
    assert traces[VALIDATION]["x"] == [*evaluated, STEPS + INTERVAL]
    wait_for_chart(page, "loss-chart", f"data[0].x.length === {STEPS + INTERVAL}")

    rows = downloaded_rows(page, "loss-chart", f"run-{run.pk}-loss.csv")
    assert rows[0] == ["trace", "step", "loss_mean"]
    validation = [(int(step), float(value)) for name, step, value in rows[1:] if name == VALIDATION]
    assert validation == [(step, pytest.approx(eval_loss(step))) for step in [*evaluated, STEPS + INTERVAL]]
    assert sum(1 for row in rows[1:] if row[0] == "attempt 1") == STEPS + INTERVAL
    assert errors == []


def test_the_compare_page_charts_each_runs_validation_loss_and_its_csv_carries_it(
    evaluating_run, unevaluated_run, open_logged_in
):
    run, other = evaluating_run[0], unevaluated_run
    page = open_logged_in("/", VIEWPORT)
    page.goto(f"/runs/compare/?runs={run.pk},{other.pk}")
    wait_for_chart(page, "loss-chart", "data.length === 2")
    wait_for_chart(page, "eval-loss-chart", "data.length >= 1")
    # The run that never evaluates has no validation line.
    (validation,) = chart_data(page, "eval-loss-chart")
    evaluated = list(range(INTERVAL, STEPS + 1, INTERVAL))
    assert (validation["name"], validation["x"]) == ("evaluating", evaluated)
    assert validation["y"] == pytest.approx([eval_loss(step) for step in evaluated])

    rows = downloaded_rows(page, "eval-loss-chart", f"compare-runs-{run.pk}-{other.pk}-eval_loss.csv")
    assert rows[0] == ["trace", "step", "eval_loss"]
    assert [(name, int(step), float(value)) for name, step, value in rows[1:]] == [
        ("evaluating", step, pytest.approx(eval_loss(step))) for step in evaluated
    ]
