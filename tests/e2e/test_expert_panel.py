"""The run page's Experts panel in real headless Chromium against the real platform: a mixture-of-experts run's
metric events, posted through the real ingest API (HTTP, the attempt's own token) as its ranks send them (one
rank per pipeline stage with its stage's layer), drawn as a heatmap of each expert's share of the tokens and a
line of the load imbalance, for the layer picked, from the snapshot and live; a dense run has no such panel."""

import csv
import io
import time

import pytest
from playwright.sync_api import expect

from ..platform.helpers import TINY_CONFIG, claimed_run
from .test_run_panels import Ingest, chart_data, drawn, launcher_running, open_run, wait_for_chart

pytestmark = pytest.mark.e2e

EXPERTS = 4
# Two pipeline stages of two data-parallel ranks: rank 0 reports layer 0, rank 2 layer 1.
MOE_CONFIG = {
    **TINY_CONFIG,
    "steps": 100,
    "model": {**TINY_CONFIG["model"], "experts": EXPERTS, "top_k": 2},
    "parallel": {"dp_replicate": 2, "pp": 2, "microbatches": 2},
}
RANKS = 4
REPORTING = {0: "0", 2: "1"}
STEPS = 20


def load_of(layer: str, step: int) -> list[int]:
    """Layer 0's router drifts onto expert 0, step by step; layer 1's favours expert 3 throughout."""
    if layer == "0":
        return [100 + 20 * step, 100, 100, 100]
    return [50, 50, 50, 250]


def shares(load: list[int]) -> list[float]:
    return [tokens / sum(load) for tokens in load]


def imbalance(load: list[int]) -> float:
    return max(load) * len(load) / sum(load)


def metric(rank: int, step: int, at: float) -> dict:
    payload = {"loss_mean": 5.0 - step / 100, "step_time_s": 0.1}
    if rank in REPORTING:
        layer = REPORTING[rank]
        payload["experts"] = {layer: {"load": load_of(layer, step), "dropped": 0, "balance_loss": 0.001 * step}}
    return {"kind": "metric", "time": at, "step": step, "payload": payload}


def train(ingest: Ingest, steps: range, at: float) -> None:
    for rank in range(RANKS):
        ingest.post(rank, [metric(rank, step, at + step) for step in steps])


@pytest.fixture
def moe_run(platform_user, platform_server):
    """A running 4-rank mixture-of-experts run that has reported STEPS steps; returns (run, Ingest, start)."""
    run, attempt, token = claimed_run(platform_user[0], "experts", MOE_CONFIG)
    ingest = Ingest(f"{platform_server.url}/api/ingest", attempt, token)
    start = time.time() - STEPS - 10
    ingest.post(-1, [launcher_running(attempt, start)])
    train(ingest, range(1, STEPS + 1), start)
    return run, ingest, start


def heatmap_columns(page) -> list[list[float]]:
    """The heatmap's shares as columns: one per step, one share per expert."""
    (heat,) = chart_data(page, "experts-heatmap")
    assert heat["y"] == list(range(EXPERTS))
    return [list(column) for column in zip(*heat["z"], strict=True)]


def test_the_experts_panel_shows_each_layers_token_shares_and_imbalance_live(moe_run, open_logged_in):
    run, ingest, start = moe_run
    errors = []
    page = open_run(open_logged_in, run.pk, errors)

    # Layer 0 by default: each expert's share of the layer's tokens, a column per step.
    wait_for_chart(page, "experts-heatmap", f"data.length === 1 && data[0].x.length === {STEPS}")
    (heat,) = chart_data(page, "experts-heatmap")
    assert heat["x"] == list(range(1, STEPS + 1))
    assert heatmap_columns(page) == [pytest.approx(shares(load_of("0", step))) for step in range(1, STEPS + 1)]
    (line,) = chart_data(page, "experts-imbalance-chart")
    assert line["x"] == list(range(1, STEPS + 1))
    assert line["y"] == pytest.approx([imbalance(load_of("0", step)) for step in range(1, STEPS + 1)])
    expect(page.locator("#experts-heatmap-note")).to_contain_text("layer 0: top 2 of 4 experts per token")

    # Layer 1, which the other pipeline stage's rank reports.
    assert page.locator("#experts-layer option").all_inner_texts() == ["0", "1"]
    page.select_option("#experts-layer", "1")
    page.wait_for_function("window.loomRun.panels.experts?.layer === '1'")
    assert heatmap_columns(page) == [pytest.approx([0.125, 0.125, 0.125, 0.625])] * STEPS
    (line,) = chart_data(page, "experts-imbalance-chart")
    assert line["y"] == pytest.approx([2.5] * STEPS)

    # Steps after the snapshot arrive over the websocket and extend the layer shown.
    page.wait_for_function("window.loomRun.socket.opened >= 1")
    live = range(STEPS + 1, STEPS + 6)
    train(ingest, live, start)
    wait_for_chart(page, "experts-heatmap", f"data[0].x[data[0].x.length - 1] === {live[-1]}")
    (heat,) = chart_data(page, "experts-heatmap")
    assert heat["x"] == list(range(1, live[-1] + 1))
    assert page.evaluate("window.loomRun.panels.experts") == {
        "attempt": 1,
        "layer": "1",
        "span": 1,
        "steps": live[-1],
    }

    # Back on layer 0, the live steps are in the answer too.
    page.select_option("#experts-layer", "0")
    page.wait_for_function("window.loomRun.panels.experts?.layer === '0'")
    drawn(page)
    assert heatmap_columns(page)[-1] == pytest.approx(shares(load_of("0", live[-1])))

    # A zoom along the steps asks for that range; a double-click (autorange) for the whole run again.
    page.evaluate("Plotly.relayout('experts-imbalance-chart', {'xaxis.range': [4.6, 9.4]})")
    wait_for_chart(page, "experts-heatmap", "data[0].x.length === 5")
    assert chart_data(page, "experts-heatmap")[0]["x"] == [5, 6, 7, 8, 9]
    page.evaluate("Plotly.relayout('experts-heatmap', {'xaxis.autorange': true})")
    wait_for_chart(page, "experts-heatmap", f"data[0].x.length === {live[-1]}")

    # The CSV holds the tokens drawn.
    with page.expect_download() as download:
        page.click(".chart-card:has(#experts-heatmap) .csv-button")
    assert download.value.suggested_filename == f"run-{run.pk}-layer-0-expert-load.csv"
    rows = list(csv.reader(io.StringIO(open(download.value.path()).read())))
    assert rows[0] == ["step", "expert", "tokens", "share"]
    assert [int(tokens) for step, _, tokens, _ in rows[1:] if int(step) == live[-1]] == load_of("0", live[-1])
    assert len(rows) == 1 + EXPERTS * live[-1]
    assert errors == []


@pytest.fixture
def dense_run(platform_user, platform_server):
    """A dense run that has reported a step."""
    run, attempt, token = claimed_run(platform_user[0], "dense", TINY_CONFIG)
    ingest = Ingest(f"{platform_server.url}/api/ingest", attempt, token)
    ingest.post(0, [{"kind": "metric", "time": time.time(), "step": 1, "payload": {"loss_mean": 5.0}}])
    return run


def test_a_dense_runs_page_has_no_experts_panel(dense_run, open_logged_in):
    errors = []
    page = open_run(open_logged_in, dense_run.pk, errors)
    wait_for_chart(page, "loss-chart", "data.length === 1")
    expect(page.locator("#experts")).to_have_count(0)
    requested = page.evaluate("performance.getEntriesByType('resource').map((entry) => entry.name)")
    assert any("/metrics/series" in url for url in requested)
    assert not any("/metrics/experts" in url or "run_experts.js" in url for url in requested)
    assert errors == []
