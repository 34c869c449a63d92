"""The run page's panels at cluster scale in real headless Chromium against the real platform: a
16-rank run's metrics, heartbeats and traffic fabricated through the real ingest API (HTTP, the
attempt's own token), read back through the data behind each Plotly chart."""

import asyncio
import csv
import io
import json
import math
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import parse_qs, urlparse

import pytest
from channels.layers import InMemoryChannelLayer
from playwright.sync_api import expect

from loom.channel_layer import RedisChannelLayer
from loom.runs.launcher import claim_attempt
from loom.runs.services import create_run

from ..platform.helpers import TINY_CONFIG, claimed_run

pytestmark = pytest.mark.e2e

# Tall enough for the whole run page: the page redraws only the charts in view, and these tests follow
# every panel at once (test_charts_out_of_view_wait_to_be_redrawn_until_they_come_into_view scrolls).
VIEWPORT = {"width": 1280, "height": 4000}
SCREENSHOT = "/tmp/loom-run-panels.png"
# 2 (dp_replicate) × 4 (dp_shard) × 2 (tp) = 16 ranks on two nodes of eight.
SIXTEEN_RANKS = {**TINY_CONFIG, "steps": 1000, "parallel": {"dp_replicate": 2, "dp_shard": 4, "tp": 2}}
RANKS = 16
DATA_PARALLEL = 8
STEPS = 600
SLOW_RANK = 5
SPIKE = (11, 120, 9.0)  # rank, step, step time: one step of one rank, far above the rest
COMM_WINDOW = 50
TP_BYTES = 4e8
DP_BYTES = 2e6
# A heatmap waits REFETCH_BACKOFF (50) times its last fetch and draw before it fetches or redraws again
# (run_charts.js): ~0.2 s on a quiet machine, but with CI's processes sharing two cores one took over 30 s.
# What these tests check is what arrives, not how soon.
LIVE_WAIT_MS = 120_000


def host_of(rank: int) -> str:
    return f"node-{'ab'[rank // 8]}"


def loss_at(step: int) -> float:
    return 5.0 - step / 200


def step_time(rank: int, step: int) -> float:
    if (rank, step) == SPIKE[:2]:
        return SPIKE[2]
    return (2.0 if rank == SLOW_RANK else 1.0) + (step % 7) / 100 + rank / 1000


def metric(rank: int, step: int, at: float, loss=loss_at) -> dict:
    payload = {
        "loss": loss(step),
        "loss_mean": loss(step),
        "grad_norm": 1.0 + step / 1000,
        "lr": 0.003 * min(1.0, step / 20),
        "step_time_s": step_time(rank, step),
        "tokens_per_s": 1000.0 + rank,
        "mfu": 0.3,
        "memory_rss": 2**30 + rank * 2**20 + step,
        "memory_peak_rss": 2**30 + rank * 2**20 + 1000,
    }
    return {"kind": "metric", "time": at, "step": step, "payload": payload}


def heartbeat(rank: int, at: float, step: int | None) -> dict:
    return {"kind": "heartbeat", "time": at, "step": step, "payload": {"host": host_of(rank), "pid": 1000 + rank}}


def comm_event(rank: int, first: int, last: int, at: float) -> dict:
    """This rank's row as the trainer's recorder sends it: its tp peer, and its neighbour in a dp ring."""
    steps = last - first + 1
    tp_peer = rank ^ 1
    dp_next = (rank + 2) % RANKS
    sends = [[tp_peer, TP_BYTES * steps, "tp", 4 * steps], [dp_next, DP_BYTES * steps, "dp", steps]]
    payload = {"rank": rank, "window": [first, last], "world_size": RANKS, "sends": sends, "time_s": 0.01 * steps}
    return {"kind": "comm", "time": at, "step": last, "payload": payload}


def launcher_running(attempt, at: float) -> dict:
    return {"kind": "state", "time": at, "payload": {"attempt": attempt.number, "state": "running"}}


class Ingest:
    """Numbered batches posted to the platform's ingest API over HTTP, as ranks and launchers send them."""

    def __init__(self, url: str, attempt, token: str):
        self.url, self.attempt, self.token = url, attempt, token
        self.seq: dict[int, int] = {}

    def post(self, rank: int, events: list[dict]) -> None:
        seq = self.seq.get(rank, 0)
        self.seq[rank] = seq + 1
        body = json.dumps({"attempt": self.attempt.pk, "rank": rank, "seq": seq, "events": events}).encode()
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        request = urllib.request.Request(self.url, data=body, headers=headers)
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200, response.read()

    def post_ranks(self, events_of_rank) -> None:
        """Every rank's batch at once, as a cluster's ranks send them."""
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(lambda rank: self.post(rank, events_of_rank(rank)), range(RANKS)))


def train(ingest: Ingest, steps: range, start: float, loss=loss_at) -> None:
    def events(rank):
        batch = [heartbeat(rank, start, steps[0])]
        for step in steps:
            batch.append(metric(rank, step, start + step, loss))
            if step % COMM_WINDOW == 0:
                batch.append(comm_event(rank, step - COMM_WINDOW + 1, step, start + step))
        return batch

    ingest.post_ranks(events)


@pytest.fixture
def sixteen_ranks(platform_user, platform_server):
    """A 16-rank run that is running and has reported STEPS steps: rank 5 twice as slow as the rest,
    one spike of rank 11, traffic every 50 steps. Returns (run, Ingest)."""
    run, attempt, token = claimed_run(platform_user[0], "sixteen ranks", SIXTEEN_RANKS)
    ingest = Ingest(f"{platform_server.url}/api/ingest", attempt, token)
    start = time.time() - STEPS - 10
    ingest.post(-1, [launcher_running(attempt, start)])
    train(ingest, range(1, STEPS + 1), start)
    return run, ingest


@pytest.fixture
def console_errors():
    return []


def open_run(open_logged_in, run_id, errors=None):
    page = open_logged_in(f"/runs/{run_id}/", VIEWPORT)
    page.set_default_timeout(LIVE_WAIT_MS)
    if errors is not None:
        page.on("pageerror", lambda error: errors.append(str(error)))
    page.wait_for_function("window.loomRun && window.loomRun.snapshotSeq !== null", timeout=LIVE_WAIT_MS)
    return page


def chart_data(page, element_id: str) -> list[dict]:
    return page.evaluate(
        """(id) => document.getElementById(id).data.map((trace) => ({
             name: trace.name, x: Array.from(trace.x || []), y: Array.from(trace.y || []),
             z: trace.z ? trace.z.map((row) => Array.from(row)) : null,
           }))""",
        element_id,
    )


def wait_for_chart(page, element_id: str, condition: str, timeout: float = LIVE_WAIT_MS):
    page.wait_for_function(
        f"""(id) => {{ const data = document.getElementById(id).data;
                      return Array.isArray(data) && ({condition}); }}""",
        arg=element_id,
        timeout=timeout,
    )


def zero_lines(page, element_id: str) -> list[bool]:
    """Whether Plotly draws its x and y zero lines on the chart, from its layout as drawn."""
    return page.evaluate(
        "(id) => { const { xaxis, yaxis } = document.getElementById(id)._fullLayout; "
        "return [xaxis.zeroline, yaxis.zeroline]; }",
        element_id,
    )


def tick_labels(page, element_id: str, axis: str) -> list[str]:
    return page.evaluate(
        "([id, axis]) => [...document.querySelectorAll(`#${id} .${axis}tick text`)].map((tick) => tick.textContent)",
        [element_id, axis],
    )


def colour_bar_labels(page, element_id: str) -> list[str]:
    return page.evaluate(
        "(id) => [...document.querySelectorAll(`#${id} .cbaxis text`)].map((tick) => tick.textContent)",
        element_id,
    )


def drawn(page) -> None:
    """Wait until what the page has applied is on its charts: it draws on the next animation frame."""
    page.evaluate("new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve)))")


def hover_text(page, element_id: str, x, y) -> str:
    """What the chart shows with the mouse over the point at (x, y), in data coordinates."""
    position = page.evaluate(
        """([id, x, y]) => {
             const chart = document.getElementById(id);
             const { xaxis, yaxis } = chart._fullLayout;
             const box = chart.querySelector(".nsewdrag").getBoundingClientRect();
             return [box.left + xaxis.l2p(xaxis.d2l(x)), box.top + yaxis.l2p(yaxis.d2l(y))];
           }""",
        [element_id, x, y],
    )
    page.mouse.move(*position)
    label = page.locator(f"#{element_id} .hoverlayer .hovertext")
    expect(label).to_have_count(1)
    text = label.text_content()
    page.mouse.move(0, 0)
    return text


# ---- the panels of a 16-rank run ----


def test_a_sixteen_rank_run_shows_every_rank_a_straggler_and_its_traffic(sixteen_ranks, open_logged_in):
    run, _ = sixteen_ranks
    errors = []
    page = open_run(open_logged_in, run.pk, errors)

    # Run-level curves: one trace per attempt, every step (600 points fit a chart's width).
    wait_for_chart(page, "loss-chart", "data.length === 1 && data[0].x.length > 0")
    (loss,) = chart_data(page, "loss-chart")
    assert loss["name"] == "attempt 1"
    assert loss["x"] == list(range(1, STEPS + 1))
    assert loss["y"] == pytest.approx([loss_at(step) for step in range(1, STEPS + 1)])
    (tokens,) = chart_data(page, "tokens-chart")
    # Rank 0's tokens/s times the 8 data-parallel ranks.
    assert set(tokens["y"]) == {1000.0 * DATA_PARALLEL}
    for chart in ("grad-norm-chart", "lr-chart", "mfu-chart"):
        (trace,) = chart_data(page, chart)
        assert len(trace["x"]) == STEPS, chart

    # The rank × step heatmap: rank 5's row is the slowest, and hovering names it and its node.
    wait_for_chart(page, "rank-heatmap", "data.length === 1 && data[0].z && data[0].z.length === 16")
    (heat,) = chart_data(page, "rank-heatmap")
    assert heat["y"] == list(range(RANKS))
    row_means = [sum(value for value in row if value is not None) / len(row) for row in heat["z"]]
    assert max(range(RANKS), key=row_means.__getitem__) == SLOW_RANK
    assert row_means[SLOW_RANK] > 1.8 and sorted(row_means)[-2] < 1.2
    # Its colours span the lowest cell to the 99th percentile: the one spiking step is above the scale
    # (drawn darkest) instead of taking it, which would leave the slow rank's stripe faint.
    cells = sorted(value for row in heat["z"] for value in row if value is not None)
    scale = page.evaluate("(({zmin, zmax}) => [zmin, zmax])(document.getElementById('rank-heatmap').data[0])")
    assert scale == [cells[0], cells[int(len(cells) * 0.99)]]
    assert SPIKE[2] in cells and scale[1] < SPIKE[2]
    page.locator("#rank-heatmap").scroll_into_view_if_needed()
    text = hover_text(page, "rank-heatmap", 300, SLOW_RANK)
    assert f"rank {SLOW_RANK} on {host_of(SLOW_RANK)}" in text and "step 300" in text
    assert "rank 12 on node-b" in hover_text(page, "rank-heatmap", 300, 12)

    # The same heatmap coloured by memory.
    page.check('input[name="heatmap-metric"][value="memory_bytes"]')
    page.wait_for_function("window.loomRun.panels.heatmap.metric === 'memory_bytes'")
    (heat,) = chart_data(page, "rank-heatmap")
    assert heat["z"][3][heat["x"].index(300)] == 2**30 + 3 * 2**20 + 300
    # Bytes in binary units, in the hover and on the colour bar (Plotly's own would be SI: "1.074GB").
    assert "1.00 GiB" in hover_text(page, "rank-heatmap", 300, 3)
    memory_colours = colour_bar_labels(page, "rank-heatmap")
    assert memory_colours and all(re.fullmatch(r"\d+(\.\d+)? GiB", label) for label in memory_colours), memory_colours
    page.check('input[name="heatmap-metric"][value="step_time_s"]')
    page.wait_for_function("window.loomRun.panels.heatmap.metric === 'step_time_s'")

    # 16 ranks are more than 8: step time is a band of min, median and max over ranks.
    wait_for_chart(page, "step-time-chart", "data.length === 3")
    band = {trace["name"]: trace for trace in chart_data(page, "step-time-chart")}
    assert set(band) == {"min", "median", "max"}
    points = zip(band["min"]["y"], band["median"]["y"], band["max"]["y"], strict=True)
    assert all(low <= mid <= high for low, mid, high in points)
    assert max(band["max"]["y"]) == SPIKE[2]
    # The spike lies in the point (a bucket of steps) that covers its step, and nowhere else.
    span = page.evaluate("window.loomRun.panels.ranks.step_time_s.span")
    spike_index = band["max"]["y"].index(SPIKE[2])
    assert band["max"]["x"][spike_index] <= SPIKE[1] < band["max"]["x"][spike_index] + span
    assert max(band["median"]["y"]) < 1.2
    assert page.evaluate("window.loomRun.panels.ranks.memory_bytes.mode") == "band"
    # A band's note names its lines instead of a legend, which Plotly would lay out again on every draw.
    expect(page.locator("#step-time-chart-note")).to_contain_text("shaded from min to max over 16 ranks")
    assert page.locator("#step-time-chart .legend").count() == 0

    # Memory per rank: its axis in binary units too.
    memory_ticks = tick_labels(page, "memory-chart", "y")
    assert memory_ticks and all(re.fullmatch(r"\d+(\.\d+)? GiB", label) for label in memory_ticks), memory_ticks

    # No zero line through rank 0's row, and a tick on whole ranks only.
    assert zero_lines(page, "rank-heatmap") == [False, False]
    assert all(label.isdigit() for label in tick_labels(page, "rank-heatmap", "y"))

    # Traffic: measured rank × rank beside the planner's prediction; the hover names the kind.
    wait_for_chart(page, "comm-measured-chart", "data.length === 1")
    (measured,) = chart_data(page, "comm-measured-chart")
    assert measured["z"][0][1] == pytest.approx(math.log10(TP_BYTES))
    assert measured["z"][0][2] == pytest.approx(math.log10(DP_BYTES))
    assert measured["z"][0][3] is None
    page.locator("#comm-measured-chart").scroll_into_view_if_needed()
    text = hover_text(page, "comm-measured-chart", 1, 0)
    assert "rank 0 → rank 1" in text and "tp" in text
    wait_for_chart(page, "comm-predicted-chart", "data.length === 1")
    assert page.evaluate("window.loomRun.panels.comm.window") == [551, 600]
    for chart in ("comm-measured-chart", "comm-predicted-chart"):
        assert zero_lines(page, chart) == [False, False], chart
    # The colour bar (beside the prediction, the two share it) at powers of two in binary units.
    traffic_colours = colour_bar_labels(page, "comm-predicted-chart")
    assert len(traffic_colours) >= 2, traffic_colours
    assert all(re.fullmatch(r"(1|2|4|8|16|32|64|128|256|512) (B|KiB|MiB|GiB)", label) for label in traffic_colours)
    # A kind picked: only the cells that kind carries most of stay.
    page.select_option("#comm-kind", "dp")
    page.wait_for_function("window.loomRun.panels.comm.kind === 'dp'")
    (measured,) = chart_data(page, "comm-measured-chart")
    assert measured["z"][0][1] is None and measured["z"][0][2] == pytest.approx(math.log10(DP_BYTES))

    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=SCREENSHOT, full_page=True)
    assert errors == []


def test_live_steps_reach_every_panel_and_their_draw_latencies_are_kept(sixteen_ranks, open_logged_in):
    run, ingest = sixteen_ranks
    page = open_run(open_logged_in, run.pk)
    # Asked for after the snapshot: the heatmap's refetches.
    heatmap_queries = []
    page.on("request", lambda request: "/metrics/heatmap?" in request.url and heatmap_queries.append(request.url))
    wait_for_chart(page, "loss-chart", f"data.length === 1 && data[0].x.length === {STEPS}")
    assert page.evaluate("window.loomRun.drawLatencies") == []
    assert page.evaluate("window.loomRun.rankDrawLatencies") == []
    assert page.evaluate("window.loomRun.memoryDrawLatencies") == []
    snapshot_seq = page.evaluate("window.loomRun.snapshotSeq")
    # Posted before the socket is open, the steps would all come by the page's catch-up from the events API.
    page.wait_for_function("window.loomRun.socket.opened >= 1")

    # The next ten steps of every rank, as each rank's next batch.
    now = time.time()
    live = range(STEPS + 1, STEPS + 11)
    ingest.post_ranks(lambda rank: [metric(rank, step, now) for step in live])
    wait_for_chart(page, "loss-chart", f"data[0].x[data[0].x.length - 1] === {live[-1]}")
    (loss,) = chart_data(page, "loss-chart")
    assert loss["x"] == list(range(1, live[-1] + 1))
    assert loss["y"][-10:] == pytest.approx([loss_at(step) for step in live])
    # One latency per step the loss chart drew: the first of the 16 ranks' reports of it.
    page.wait_for_function(f"window.loomRun.drawLatencies.length === {len(live)}")
    assert all(0 < latency < 300_000 for latency in page.evaluate("window.loomRun.drawLatencies"))
    # ...and one per rank and step that changed the step-time band: every rank's report of a step past
    # the snapshot's last bucket, and those inside it only where they widen its min or max.
    span = page.evaluate("window.loomRun.panels.ranks.step_time_s.span")
    past_last_bucket = sum(1 for step in live if step > STEPS // span * span + span - 1)
    page.wait_for_function(f"window.loomRun.rankDrawLatencies.length >= {RANKS * past_last_bucket}")
    rank_latencies = page.evaluate("window.loomRun.rankDrawLatencies")
    assert RANKS * past_last_bucket <= len(rank_latencies) <= RANKS * len(live)
    assert all(0 < latency < 300_000 for latency in rank_latencies)
    # The memory band's points the same way: every rank's memory differs at every step.
    page.wait_for_function(f"window.loomRun.memoryDrawLatencies.length >= {RANKS * past_last_bucket}")
    memory_latencies = page.evaluate("window.loomRun.memoryDrawLatencies")
    assert RANKS * past_last_bucket <= len(memory_latencies) <= RANKS * len(live)
    assert all(0 < latency < 300_000 for latency in memory_latencies)
    # Those that came over the websocket are split into stages (one clock here: none runs backwards).
    stages = page.evaluate("window.loomRun.rankDrawStages")
    assert 1 <= len(stages) <= len(rank_latencies)
    now_ms = time.time() * 1000
    for to_sent, to_received, to_drawn, drawn_at in stages:
        assert to_sent > 0 and to_received > -1 and to_drawn >= 0
        assert now_ms - 300_000 < drawn_at <= now_ms
    # The heavy panels' fetches and draws are kept beside them, for the benchmark to tell what late points
    # waited behind.
    heavy = page.evaluate("window.loomRun.heavyWork")
    assert {(panel, part) for panel, part, _, _ in heavy} >= {("heatmap", "fetch"), ("heatmap", "draw")}
    assert all(now_ms - 300_000 < start <= end <= now_ms for _, _, start, end in heavy)
    # Every rank's events applied one by one after the snapshot, not replayed from it.
    page.wait_for_function(f"window.loomRun.lastSeq === {snapshot_seq + RANKS * len(live)}")
    drawn(page)

    # The band's steps after its last bucket are computed from the 16 ranks' reports.
    wait_for_chart(page, "step-time-chart", f"data[2].x[data[2].x.length - 1] === {live[-1]}")
    band = {trace["name"]: trace for trace in chart_data(page, "step-time-chart")}
    step = live[-1]
    times = sorted(step_time(rank, step) for rank in range(RANKS))
    assert band["min"]["y"][-1] == pytest.approx(times[0])
    assert band["median"]["y"][-1] == pytest.approx((times[7] + times[8]) / 2)
    assert band["max"]["y"][-1] == pytest.approx(step_time(SLOW_RANK, step))
    # The heatmap, one step per column, takes the live steps from the events and is not fetched again. It
    # is redrawn at most every 2 s, or fifty times its last draw's cost.
    wait_for_chart(page, "rank-heatmap", f"data[0].x[data[0].x.length - 1] === {live[-1]}")
    (heat,) = chart_data(page, "rank-heatmap")
    assert heat["x"] == list(range(1, live[-1] + 1))
    assert heat["z"][SLOW_RANK][-1] == pytest.approx(step_time(SLOW_RANK, live[-1]))
    assert [row[-len(live) :] for row in heat["z"]] == [
        pytest.approx([step_time(rank, step) for step in live]) for rank in range(RANKS)
    ]
    assert heatmap_queries == []

    # Each rank's traffic of a new window: the matrix is fetched again and shows that window.
    assert page.evaluate("window.loomRun.panels.comm.window") == [551, 600]
    page.evaluate(
        """() => { window.predictedDraws = 0;
                   const chart = document.getElementById("comm-predicted-chart");
                   chart.on("plotly_afterplot", () => window.predictedDraws++); }"""
    )
    ingest.post_ranks(lambda rank: [comm_event(rank, live[0], live[-1], now)])
    page.wait_for_function(f"window.loomRun.panels.comm.window[0] === {live[0]}", timeout=LIVE_WAIT_MS)
    drawn(page)
    # The prediction of a layout does not change with the window: it is not drawn again.
    assert page.evaluate("window.predictedDraws") == 0


def test_csv_of_a_chart_holds_exactly_what_it_draws(sixteen_ranks, open_logged_in, tmp_path):
    run, _ = sixteen_ranks
    page = open_run(open_logged_in, run.pk)
    wait_for_chart(page, "loss-chart", f"data.length === 1 && data[0].x.length === {STEPS}")
    with page.expect_download() as download:
        page.click(".chart-card:has(#loss-chart) .csv-button")
    assert download.value.suggested_filename == f"run-{run.pk}-loss.csv"
    rows = list(csv.reader(io.StringIO(open(download.value.path()).read())))
    assert rows[0] == ["trace", "step", "loss_mean"]
    (loss,) = chart_data(page, "loss-chart")
    assert [(name, int(step), float(value)) for name, step, value in rows[1:]] == [
        ("attempt 1", step, value) for step, value in zip(loss["x"], loss["y"], strict=True)
    ]

    wait_for_chart(page, "rank-heatmap", "data.length === 1 && data[0].z && data[0].z.length === 16")
    with page.expect_download() as download:
        page.click(".chart-card:has(#rank-heatmap) .csv-button")
    rows = list(csv.reader(io.StringIO(open(download.value.path()).read())))
    assert rows[0] == ["rank", "host", "step", "step_time_s"]
    (heat,) = chart_data(page, "rank-heatmap")
    assert len(rows) - 1 == RANKS * len(heat["x"])
    by_cell = {(int(rank), int(step)): (host, float(value)) for rank, host, step, value in rows[1:]}
    assert by_cell[(SLOW_RANK, 300)] == (host_of(SLOW_RANK), heat["z"][SLOW_RANK][heat["x"].index(300)])


def test_charts_out_of_view_wait_to_be_redrawn_until_they_come_into_view(sixteen_ranks, open_logged_in):
    run, ingest = sixteen_ranks
    page = open_logged_in(f"/runs/{run.pk}/", {"width": 1280, "height": 800})
    page.wait_for_function("window.loomRun && window.loomRun.snapshotSeq !== null", timeout=LIVE_WAIT_MS)
    heatmap_queries = []
    page.on("request", lambda request: "/metrics/heatmap?" in request.url and heatmap_queries.append(request.url))
    # Drawn once from the snapshot, wherever they are.
    wait_for_chart(page, "loss-chart", f"data.length === 1 && data[0].x.length === {STEPS}")
    wait_for_chart(page, "step-time-chart", "data.length === 3")
    drawn(page)
    page.evaluate(
        """() => { window.redraws = { "loss-chart": 0, "step-time-chart": 0 };
                   for (const id of Object.keys(window.redraws))
                     document.getElementById(id).on("plotly_afterplot", () => window.redraws[id]++); }"""
    )

    # Past the band's last bucket of 8 steps, so its last point moves.
    live = range(STEPS + 1, STEPS + 11)
    now = time.time()
    ingest.post_ranks(lambda rank: [metric(rank, step, now) for step in live])
    # The page takes every event (the ranks' posts arrive one after another)…
    every_event = page.evaluate("window.loomRun.snapshotSeq") + RANKS * len(live)
    page.wait_for_function(f"window.loomRun.lastSeq === {every_event}", timeout=LIVE_WAIT_MS)
    wait_for_chart(page, "loss-chart", f"data[0].x[data[0].x.length - 1] === {live[-1]}")
    drawn(page)
    # …and redraws the loss chart at the top, not the step-time band below the fold.
    assert page.evaluate("window.redraws['loss-chart']") >= 1
    assert page.evaluate("window.redraws['step-time-chart']") == 0
    assert page.evaluate("document.getElementById('step-time-chart').data[2].x.at(-1)") < live[-1]

    # The heatmap below takes the live steps without a fetch; its redraw waits for it to come into view.
    page.wait_for_function(
        "[...window.loomRun.waitingForView.keys()].some((chart) => chart.id === 'rank-heatmap')", timeout=LIVE_WAIT_MS
    )
    assert page.evaluate("document.getElementById('rank-heatmap').data[0].x.at(-1)") == STEPS

    # Scrolled to, each is drawn with what arrived meanwhile.
    page.locator("#step-time-chart").scroll_into_view_if_needed()
    wait_for_chart(page, "step-time-chart", f"data[2].x[data[2].x.length - 1] === {live[-1]}")
    assert page.evaluate("window.redraws['step-time-chart']") >= 1
    page.locator("#rank-heatmap").scroll_into_view_if_needed()
    wait_for_chart(page, "rank-heatmap", f"data[0].x[data[0].x.length - 1] === {live[-1]}")
    assert heatmap_queries == []


@pytest.fixture
def no_step_yet(platform_user, platform_server):
    """A 16-rank run whose launcher reported it running, and no rank a step. Returns (run, Ingest)."""
    run, attempt, token = claimed_run(platform_user[0], "no step yet", SIXTEEN_RANKS)
    ingest = Ingest(f"{platform_server.url}/api/ingest", attempt, token)
    ingest.post(-1, [launcher_running(attempt, time.time())])
    return run, ingest


def test_the_snapshot_is_asked_for_while_plotly_is_still_arriving(sixteen_ranks, open_logged_in):
    """Plotly (4.8 MB) is loaded async: the page's API requests go out before it has arrived, and its
    charts are created and drawn once it has run."""
    run, _ = sixteen_ranks
    page = open_run(open_logged_in, run.pk)
    delay_s = 2.0

    def late_plotly(route):
        time.sleep(delay_s)
        route.continue_()

    # A routed page bypasses the browser's cache, so Plotly is fetched again, late.
    page.route("**/plotly/plotly.min.js", late_plotly)
    page.reload()
    page.wait_for_function("window.loomRun && window.loomRun.snapshotSeq !== null", timeout=LIVE_WAIT_MS)
    wait_for_chart(page, "rank-heatmap", "data.length === 1 && data[0].z && data[0].z.length === 16")
    (heat,) = chart_data(page, "rank-heatmap")
    assert max(range(RANKS), key=lambda rank: sum(heat["z"][rank]) / len(heat["z"][rank])) == SLOW_RANK
    timings = page.evaluate(
        "() => performance.getEntriesByType('resource')"
        ".map((entry) => [entry.name, entry.startTime, entry.responseEnd])"
    )
    (plotly_arrived,) = [end for name, _, end in timings if name.endswith("plotly.min.js")]
    asked = [start for name, start, _ in timings if f"/api/runs/{run.pk}/metrics/" in name]
    assert plotly_arrived > delay_s * 1000 and asked and min(asked) < plotly_arrived - delay_s * 500


def test_a_page_opened_before_the_first_step_builds_its_heatmap_from_live_steps(no_step_yet, open_logged_in):
    run, ingest = no_step_yet
    start = time.time()
    page = open_run(open_logged_in, run.pk)
    page.wait_for_function("window.loomRun.panels.heatmap && window.loomRun.panels.heatmap.steps === 0")
    heatmap_queries = []
    page.on("request", lambda request: "/metrics/heatmap?" in request.url and heatmap_queries.append(request.url))

    train(ingest, range(1, 4), start)
    wait_for_chart(page, "rank-heatmap", "data[0].x.length === 3", timeout=LIVE_WAIT_MS)
    (heat,) = chart_data(page, "rank-heatmap")
    assert heat["x"] == [1, 2, 3]
    assert heat["z"][SLOW_RANK] == pytest.approx([step_time(SLOW_RANK, step) for step in (1, 2, 3)])
    assert heatmap_queries == []


def test_a_heatmap_of_buckets_is_fetched_again_from_its_last_columns(sixteen_ranks, open_logged_in):
    run, ingest = sixteen_ranks
    # Too narrow for one column per step: each column is a bucket of the server's tiles, which live
    # steps cannot extend.
    page = open_logged_in(f"/runs/{run.pk}/", {"width": 560, "height": 900})
    page.wait_for_function("window.loomRun && window.loomRun.snapshotSeq !== null", timeout=LIVE_WAIT_MS)
    wait_for_chart(page, "rank-heatmap", "data.length === 1 && data[0].z && data[0].z.length === 16")
    span = page.evaluate("window.loomRun.panels.heatmap.span")
    assert span > 1
    heatmap_queries = []
    page.on("request", lambda request: "/metrics/heatmap?" in request.url and heatmap_queries.append(request.url))
    page.locator("#rank-heatmap").scroll_into_view_if_needed()

    live = range(STEPS + 1, STEPS + 11)
    now = time.time()
    ingest.post_ranks(lambda rank: [metric(rank, step, now) for step in live])
    last_bucket = live[-1] // span * span
    wait_for_chart(page, "rank-heatmap", f"data[0].x[data[0].x.length - 1] === {last_bucket}", timeout=LIVE_WAIT_MS)
    (heat,) = chart_data(page, "rank-heatmap")
    assert heat["x"] == list(range(0, last_bucket + 1, span))
    in_last = [step for step in live if step >= last_bucket]
    assert heat["z"][SLOW_RANK][-1] == pytest.approx(sum(step_time(SLOW_RANK, step) for step in in_last) / len(in_last))
    # Only its last columns onwards are asked for, at the span it shows, and joined to the ones it held.
    refetches = [parse_qs(urlparse(url).query) for url in heatmap_queries]
    assert refetches and all(
        query["span"] == [str(span)] and int(query["start"][0]) >= STEPS - 4 * span for query in refetches
    )


def test_zooming_asks_for_that_range_and_a_double_click_goes_back(sixteen_ranks, open_logged_in):
    run, _ = sixteen_ranks
    page = open_run(open_logged_in, run.pk)
    wait_for_chart(page, "step-time-chart", "data.length === 3")
    coarse = page.evaluate("window.loomRun.panels.ranks.step_time_s.span")
    assert coarse > 1, "600 steps should not fit the band's width at one step a point"

    with page.expect_response(lambda r: "/metrics/ranks?" in r.url and "start=100" in r.url and "end=300" in r.url):
        page.evaluate("Plotly.relayout('step-time-chart', {'xaxis.range': [100, 300]})")
    page.wait_for_function("window.loomRun.panels.ranks.step_time_s.span === 1")
    band = {trace["name"]: trace for trace in chart_data(page, "step-time-chart")}
    assert band["max"]["x"] == list(range(100, 301))
    assert band["max"]["y"][SPIKE[1] - 100] == SPIKE[2]

    # A double-click (autorange) goes back to the whole run.
    page.evaluate("Plotly.relayout('step-time-chart', {'xaxis.autorange': true})")
    page.wait_for_function(f"window.loomRun.panels.ranks.step_time_s.span === {coarse}")

    # The heatmap and the run-level curves refine on zoom too.
    with page.expect_response(lambda r: "/metrics/heatmap?" in r.url and "start=250" in r.url):
        page.evaluate("Plotly.relayout('rank-heatmap', {'xaxis.range': [250, 260]})")
    wait_for_chart(page, "rank-heatmap", "data[0].x.length === 11")
    with page.expect_response(lambda r: "/metrics/series?" in r.url and "start=10" in r.url):
        page.evaluate("Plotly.relayout('loss-chart', {'xaxis.range': [10, 20]})")
    wait_for_chart(page, "loss-chart", "data[0].x.length === 11")


def test_picked_ranks_are_drawn_as_lines(sixteen_ranks, open_logged_in):
    run, _ = sixteen_ranks
    page = open_run(open_logged_in, run.pk)
    wait_for_chart(page, "step-time-chart", "data.length === 3")
    page.fill("#rank-pick", "99")
    page.press("#rank-pick", "Enter")
    expect(page.locator("#rank-pick-error")).to_contain_text("rank 99 is not in this attempt's 0–15")
    page.fill("#rank-pick", "0, 5")
    page.press("#rank-pick", "Enter")
    expect(page.locator("#rank-pick-error")).to_be_hidden()
    wait_for_chart(page, "step-time-chart", "data.length === 2 && data[0].name === 'rank 0'")
    lines = {trace["name"]: trace for trace in chart_data(page, "step-time-chart")}
    assert set(lines) == {"rank 0", "rank 5"}
    # Lines are told apart by their legend.
    expect(page.locator("#step-time-chart .legend")).to_contain_text("rank 5")
    assert min(lines["rank 5"]["y"]) > max(lines["rank 0"]["y"])
    wait_for_chart(page, "memory-chart", "data.length === 2")


PLANNED_CLUSTER = {"gpu": "H100-SXM", "nodes": 1, "gpus_per_node": 2}


def started(device: str, device_name: str, at: float) -> dict:
    payload = {"state": "started", "world_size": 2, "device": device, "device_name": device_name}
    return {"kind": "state", "time": at, "payload": payload}


@pytest.fixture
def planned_for_h100s(request, platform_user, platform_server):
    """A 2-rank run created with the planner's estimate for two H100s, whose ranks report that they started
    on the device the test names, (device, device_name), and trained 30 steps; on CPU without MFU, as the
    trainer reports there."""
    device, device_name = request.param
    run = create_run(platform_user[0], f"planned for H100s, ran on {device_name}", TINY_CONFIG, PLANNED_CLUSTER)
    attempt, token = claim_attempt(run.attempts.get().pk)
    ingest = Ingest(f"{platform_server.url}/api/ingest", attempt, token)
    start = time.time() - 40
    ingest.post(-1, [launcher_running(attempt, start)])
    for rank in (0, 1):
        steps = [metric(rank, step, start + step) for step in range(1, 31)]
        if device == "cpu":
            for step in steps:
                step["payload"]["mfu"] = None
        ingest.post(rank, [started(device, device_name, start), *steps])
    return run


def layout_of(page, element_id: str) -> dict:
    return page.evaluate(
        """(id) => { const { xaxis, yaxis, annotations } = document.getElementById(id)._fullLayout;
                     return { x: xaxis.visible, y: yaxis.visible, notes: annotations.map((note) => note.text) }; }""",
        element_id,
    )


@pytest.mark.parametrize("planned_for_h100s", [("cpu", "CPU")], indirect=True)
def test_a_run_planned_for_gpus_that_ran_on_cpu_says_the_prediction_does_not_apply(planned_for_h100s, open_logged_in):
    run = planned_for_h100s
    errors = []
    page = open_run(open_logged_in, run.pk, errors)
    expect(page.locator("#prediction-hardware")).to_have_text(
        "planned for 2 × H100-SXM; this attempt ran on CPU: the prediction does not apply"
    )
    expect(page.locator("#measured-heading")).to_have_text("Measured on CPU")
    expect(page.locator("#predicted-tokens")).to_have_text("–")
    expect(page.locator("#predicted-memory")).to_have_text("–")
    # Measured all the same: 1,000 tokens/s of rank 0's batch times 2 data-parallel ranks.
    expect(page.locator("#measured-tokens")).to_have_text("2,000")

    # No MFU on CPU: a note instead of an empty chart with Plotly's -100 % to 400 % axis.
    wait_for_chart(page, "loss-chart", "data.length === 1")
    page.wait_for_function("document.getElementById('mfu-chart')._fullLayout.annotations.length === 1")
    assert chart_data(page, "mfu-chart") == []
    assert layout_of(page, "mfu-chart") == {"x": False, "y": False, "notes": ["MFU is not measured on CPU"]}
    assert layout_of(page, "loss-chart") == {"x": True, "y": True, "notes": []}

    page.goto(f"/runs/compare/?runs={run.pk}")
    wait_for_chart(page, "loss-chart", "data.length === 1")
    wait_for_chart(page, "mfu-chart", "true")
    assert chart_data(page, "mfu-chart") == []
    assert layout_of(page, "mfu-chart") == {
        "x": False,
        "y": False,
        "notes": ["no MFU reported: it is not measured on CPU"],
    }
    assert errors == []


@pytest.mark.parametrize(
    ("planned_for_h100s", "note"),
    [
        (("cuda:0", "NVIDIA H100 80GB HBM3"), ""),
        (
            ("cuda:0", "NVIDIA A100-SXM4-80GB"),
            "planned for 2 × H100-SXM; this attempt ran on NVIDIA A100-SXM4-80GB: the prediction does not apply",
        ),
    ],
    indirect=["planned_for_h100s"],
)
def test_a_run_on_gpus_shows_the_prediction_only_beside_the_gpus_it_was_made_for(
    planned_for_h100s, open_logged_in, note
):
    run = planned_for_h100s
    device_name = run.name.removeprefix("planned for H100s, ran on ")
    page = open_run(open_logged_in, run.pk)
    expect(page.locator("#measured-heading")).to_have_text(f"Measured on {device_name}")
    hardware_note = page.locator("#prediction-hardware")
    if note:
        expect(hardware_note).to_have_text(note)
        expect(page.locator("#predicted-tokens")).to_have_text("–")
    else:
        expect(hardware_note).to_be_hidden()
        predicted = f"{round(run.estimate['tokens_per_s']):,}"
        expect(page.locator("#predicted-tokens")).to_have_text(predicted)
    wait_for_chart(page, "mfu-chart", "data.length === 1")


def other_loss(step: int) -> float:
    return 6.0 - step / 50


@pytest.fixture
def two_rank_run(platform_user, platform_server):
    """Another run, of 2 data-parallel ranks and 100 steps with another loss curve."""
    run, attempt, token = claimed_run(platform_user[0], "lower lr", {**TINY_CONFIG, "steps": 100})
    ingest = Ingest(f"{platform_server.url}/api/ingest", attempt, token)
    start = time.time() - 100
    for rank in (0, 1):
        ingest.post(rank, [metric(rank, step, start + step, loss=other_loss) for step in range(1, 101)])
    return run


def test_the_compare_page_overlays_the_runs_picked_on_the_run_list(sixteen_ranks, two_rank_run, open_logged_in):
    run, _ = sixteen_ranks
    other = two_rank_run
    page = open_logged_in("/", VIEWPORT)
    page.check(f'tr[data-run="{run.pk}"] input[name="runs"]')
    page.check(f'tr[data-run="{other.pk}"] input[name="runs"]')
    page.click("#compare-runs")
    page.wait_for_url(re.compile(r"/runs/compare/\?"))
    expect(page.locator("#compared-runs li")).to_have_count(2)
    wait_for_chart(page, "loss-chart", "data.length === 2")
    traces = {trace["name"]: trace for trace in chart_data(page, "loss-chart")}
    assert set(traces) == {"sixteen ranks", "lower lr"}
    assert traces["sixteen ranks"]["x"] == list(range(1, STEPS + 1))
    assert traces["lower lr"]["y"] == pytest.approx([other_loss(step) for step in range(1, 101)])
    # Throughput of each run with its own data-parallel degree: 8 and 2.
    tokens = {trace["name"]: set(trace["y"]) for trace in chart_data(page, "tokens-chart")}
    assert tokens == {"sixteen ranks": {8000.0}, "lower lr": {2000.0}}

    # The same page by its short address, and another user's run is not found there.
    response = page.goto(f"/runs/compare/?runs={run.pk},{other.pk}")
    assert response.status == 200
    wait_for_chart(page, "loss-chart", "data.length === 2")
    assert page.goto(f"/runs/compare/?runs={run.pk},{other.pk + 1000}").status == 404


# ---- a channel layer that drops messages ----

RAW_SOCKET = """async (path) => {
  window.rawSocketSeqs = [];
  window.rawSocketMessages = 0;
  const socket = new WebSocket(`ws://${location.host}${path}`);
  socket.onmessage = (message) => {
    window.rawSocketMessages += 1;
    for (const event of JSON.parse(message.data).events) window.rawSocketSeqs.push(event.seq);
  };
  await new Promise((resolve, reject) => { socket.onopen = resolve; socket.onerror = reject; });
}"""


# A consumer that takes this long over each message while the fan-out sends one every 0.1 s: with one
# message of room in its channel, most of what is sent meanwhile is dropped.
RECEIVE_DELAY_S = 0.3


class SlowConsumerLayer:
    """A channel layer whose consumers take RECEIVE_DELAY_S over each message, as a loaded web
    process's would. With capacity 1 the layer then drops group messages; without the delay the
    coalesced fan-out (one message per 0.1 s) never finds a consumer's channel full."""

    async def receive(self, channel):
        message = await super().receive(channel)
        await asyncio.sleep(RECEIVE_DELAY_S)
        return message


class SlowInMemoryChannelLayer(SlowConsumerLayer, InMemoryChannelLayer):
    pass


class SlowRedisChannelLayer(SlowConsumerLayer, RedisChannelLayer):
    pass


@pytest.fixture
def lossy_channel_layer(settings):
    """Every consumer's channel holds one message: a group send to a consumer that has not taken the
    last one yet is dropped (channels_redis drops silently over its capacity, the in-memory layer too)."""
    if settings.REDIS_URL:
        hosts = [{"address": settings.REDIS_URL, "socket_timeout": settings.CHANNEL_LAYER_READ_TIMEOUT_S}]
        config = {"hosts": hosts, "capacity": 1, "prefix": f"lossy-{time.monotonic_ns()}"}
        layer = SlowRedisChannelLayer
    else:
        config = {"capacity": 1}
        layer = SlowInMemoryChannelLayer
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": f"{__name__}.{layer.__name__}", "CONFIG": config}}


def test_with_the_channel_layer_dropping_messages_the_page_still_ends_with_every_point(
    lossy_channel_layer, sixteen_ranks, open_logged_in
):
    run, ingest = sixteen_ranks
    page = open_run(open_logged_in, run.pk)
    page.wait_for_function("window.loomRun.socket.opened === 1")
    page.evaluate(RAW_SOCKET, f"/ws/runs/{run.pk}/")
    seq_before = page.evaluate("window.loomRun.lastSeq")
    applied_before = page.evaluate("window.loomRun.appliedSeqs")

    # A burst: every rank posts each of 40 steps as its own batch, 640 batches as fast as they go.
    burst = range(STEPS + 1, STEPS + 41)
    now = time.time()
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda rank: [ingest.post(rank, [metric(rank, step, now)]) for step in burst], range(RANKS)))
    last_seq = seq_before + RANKS * len(burst)

    page.wait_for_function(f"window.loomRun.lastSeq === {last_seq}", timeout=LIVE_WAIT_MS)
    drawn(page)
    # Every point, each once: the loss of every step, the band's last steps from all 16 ranks.
    wait_for_chart(page, "loss-chart", f"data[0].x[data[0].x.length - 1] === {burst[-1]}")
    (loss,) = chart_data(page, "loss-chart")
    assert loss["x"] == list(range(1, burst[-1] + 1))
    band = {trace["name"]: trace for trace in chart_data(page, "step-time-chart")}
    assert band["max"]["x"][-1] == burst[-1]
    assert band["max"]["y"][-1] == pytest.approx(step_time(SLOW_RANK, burst[-1]))
    # Each event of the burst applied once, whether it came over the socket or from the events API.
    assert page.evaluate("window.loomRun.appliedSeqs") - applied_before == last_seq - seq_before

    # The layer did drop: a plain websocket client beside the page missed events of the burst, and
    # the page filled them in from the events API after seeing the gaps.
    page.wait_for_timeout(1000)
    raw = page.evaluate("window.rawSocketSeqs")
    assert set(raw) <= set(range(seq_before + 1, last_seq + 1))
    counts = page.evaluate("({socket: window.loomRun.socket, fetched: window.loomRun.fetched})")
    assert len(set(raw)) < last_seq - seq_before
    assert counts["socket"]["gaps"] > 0 and counts["fetched"]["events"] > 0
    assert counts["socket"]["opened"] == 1
