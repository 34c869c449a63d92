"""The run pages in real headless Chromium against the real platform: uvicorn + Channels, a Celery
worker, torchrun training a tiny model on CPU. Nothing is stubbed between the browser and the ranks."""

import os
import re

import pytest
from playwright.sync_api import expect

from .tiny_run import TINY_RUN_INPUTS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SCREENSHOT = "/tmp/loom-run.png"
TRAINING_TIMEOUT_MS = 240_000
RANKS = ["0", "1"]
CLOSE_FIRST_SOCKET_AFTER_MESSAGES = 4

# Attempts of up to 8 ranks draw a line per rank on the per-rank charts.
LIVE_POINTS_FROM_EVERY_RANK = """(ranks) => {
  const lines = document.getElementById("step-time-chart").data || [];
  const drawn = (rank) => lines.some((line) => line.name === `rank ${rank}` && line.x.length > 0);
  return window.loomRun.state === "running" && ranks.every(drawn);
}"""
# What the page holds from the charts' snapshot instead of applying the events one by one.
SNAPSHOT_KINDS = {"metric", "heartbeat", "comm"}


@pytest.fixture
def page(live_platform, open_logged_in):
    """The run list, logged in through the login form."""
    return open_logged_in("/", {"width": 1280, "height": 1100})


def create_run_through_the_form(page, name: str, steps: int) -> int:
    page.goto("/runs/new/")
    page.fill("#id_name", name)
    for field, value in {**TINY_RUN_INPUTS, "steps": str(steps)}.items():
        page.fill(f'[name="{field}"]', value)
    page.click("button:has-text('Create run')")
    page.wait_for_url(re.compile(r"/runs/\d+/$"))
    return int(re.search(r"/runs/(\d+)/$", page.url).group(1))


def wait_for_live_points(page):
    """Loss points from every rank while the run still reads running: drawn live, not replayed at the end."""
    page.wait_for_function(LIVE_POINTS_FROM_EVERY_RANK, arg=RANKS, polling="raf", timeout=TRAINING_TIMEOUT_MS)


def rank_steps(page, chart: str = "step-time-chart") -> dict[str, list[int]]:
    """The steps each rank's line holds on a per-rank chart."""
    lines = page.evaluate(f"document.getElementById('{chart}').data.map((line) => [line.name, Array.from(line.x)])")
    return {name.removeprefix("rank "): steps for name, steps in lines}


def series_steps(page, chart: str, attempt: int = 1) -> list[int]:
    return [step for step, _ in page.evaluate(f"window.loomRun.series.{chart}[{attempt}] || []")]


def all_events(page, run_id: int) -> list[dict]:
    """Every stored event of the run, through the same REST API the page resyncs from."""
    return page.evaluate(
        """async (runId) => {
          const events = [];
          let page;
          do {
            const after = events.length ? events[events.length - 1].seq : 0;
            page = await (await fetch(`/api/runs/${runId}/events?after=${after}&limit=5000`)).json();
            events.push(...page.events);
          } while (page.more);
          return events;
        }""",
        run_id,
    )


def assert_page_holds_every_event_once(page, run_id: int):
    """Every event up to the last is applied exactly once, but for the metrics, heartbeats and traffic
    the charts' snapshot held when the page loaded."""
    events = all_events(page, run_id)
    seen = page.evaluate("""({
        lastSeq: loomRun.lastSeq, appliedSeqs: loomRun.appliedSeqs, snapshot: loomRun.snapshotSeq
    })""")
    in_snapshot = sum(1 for event in events if event["seq"] <= seen["snapshot"] and event["kind"] in SNAPSHOT_KINDS)
    assert (seen["lastSeq"], seen["appliedSeqs"]) == (events[-1]["seq"], len(events) - in_snapshot)


def test_a_run_trains_live_on_the_page_to_success(page):
    steps = 30
    run_id = create_run_through_the_form(page, "tiny live run", steps)
    expect(page.locator("h1")).to_contain_text("tiny live run")

    wait_for_live_points(page)
    expect(page.locator("#cancel-run")).to_be_visible()

    expect(page.locator("#run-state")).to_have_text("succeeded", timeout=TRAINING_TIMEOUT_MS)
    every_step = list(range(1, steps + 1))
    assert rank_steps(page) == rank_steps(page, "memory-chart") == {rank: every_step for rank in RANKS}
    assert series_steps(page, "tokens_per_s") == series_steps(page, "grad_norm") == every_step
    assert_page_holds_every_event_once(page, run_id)
    expect(page.locator("#cancel-run")).to_be_hidden()
    expect(page.locator('tr[data-attempt="1"] .attempt-state')).to_have_text("succeeded")
    expect(page.locator('tr[data-attempt="1"] .attempt-exit-code')).to_have_text("0")
    # One trace per attempt, the loss every rank agreed on (its mean over the ranks holding one).
    assert page.evaluate("document.querySelectorAll('#loss-chart .scatterlayer .trace').length") == 1
    assert page.evaluate("document.getElementById('loss-chart').data.map((trace) => trace.name)") == ["attempt 1"]
    assert [step for step, _ in page.evaluate("window.loomRun.series.loss[1]")] == list(range(1, steps + 1))

    page.select_option("#log-rank", "1")
    expect(page.locator("#live-log")).to_contain_text(f"INFO trainer.train: training {steps} steps")
    expect(page.locator("#live-log")).to_contain_text("rank 1 finished")
    page.click("#load-captured")
    expect(page.locator("#captured-logs")).to_contain_text("stdout.log")
    expect(page.locator("#captured-logs")).to_contain_text(f"rank 1 step {steps}/{steps}")
    page.screenshot(path=SCREENSHOT, full_page=True)


def test_dropped_socket_messages_and_a_reconnect_leave_no_gap_and_no_duplicate(page):
    """Every other websocket message is dropped and the first socket is closed under the page:
    the charts must still hold every step exactly once, filled in from the events API."""
    sockets_opened = []

    def lossy_socket(client):
        server = client.connect_to_server()
        sockets_opened.append(client)
        received = 0

        def forward_every_other(message):
            nonlocal received
            received += 1
            if received % 2:
                client.send(message)
            if len(sockets_opened) == 1 and received == CLOSE_FIRST_SOCKET_AFTER_MESSAGES:
                client.close()

        server.on_message(forward_every_other)

    page.route_web_socket(re.compile(r"/ws/runs/\d+/$"), lossy_socket)
    steps = 150
    run_id = create_run_through_the_form(page, "lossy socket run", steps)

    expect(page.locator("#run-state")).to_have_text("succeeded", timeout=TRAINING_TIMEOUT_MS)
    # The disconnect notice goes away when a socket opens again.
    expect(page.locator("#page-notice")).to_be_hidden()
    assert len(sockets_opened) >= 2, "the page never reconnected after its socket closed"
    assert rank_steps(page) == {rank: list(range(1, steps + 1)) for rank in RANKS}
    assert series_steps(page, "loss") == list(range(1, steps + 1))
    assert_page_holds_every_event_once(page, run_id)


def test_cancel_stops_a_running_run_and_its_whole_process_group(page):
    run_id = create_run_through_the_form(page, "long run to cancel", 100_000)
    wait_for_live_points(page)

    page.click("#cancel-run")
    expect(page.locator("#run-state")).to_have_text("cancelled", timeout=60_000)
    expect(page.locator("#cancel-run")).to_be_hidden()
    expect(page.locator('tr[data-attempt="1"] .attempt-state')).to_have_text("cancelled")
    expect(page.locator('tr[data-attempt="1"] .attempt-reason')).to_contain_text("cancelled by user")

    launcher_states = [e["payload"] for e in all_events(page, run_id) if e["kind"] == "state" and e["rank"] == -1]
    (running,) = [payload for payload in launcher_states if payload["state"] == "running"]
    with pytest.raises(ProcessLookupError):
        os.killpg(running["pid"], 0)
    assert_page_holds_every_event_once(page, run_id)


def test_a_three_dimensional_layout_launches_from_the_form_and_reports_every_rank(page):
    """pp2 × dp2 × tp2 on 8 ranks: loss comes from the last pipeline stage (ranks 4–7, pp outermost),
    throughput and the other metrics from every rank."""
    steps = 4
    page.goto("/runs/new/")
    page.fill("#id_name", "pp2 dp2 tp2")
    layout = {
        **TINY_RUN_INPUTS,
        "steps": str(steps),
        "parallel.dp_replicate": "1",
        "parallel.dp_shard": "2",
        "parallel.tp": "2",
        "parallel.pp": "2",
        "parallel.microbatches": "2",
    }
    for field, value in layout.items():
        page.fill(f'[name="{field}"]', value)
    page.select_option('[name="parallel.pp_schedule"]', "1F1B")
    page.click("button:has-text('Create run')")
    page.wait_for_url(re.compile(r"/runs/\d+/$"))

    expect(page.locator("#run-state")).to_have_text("succeeded", timeout=TRAINING_TIMEOUT_MS)
    every_step = list(range(1, steps + 1))
    assert series_steps(page, "loss") == series_steps(page, "tokens_per_s") == every_step
    assert rank_steps(page) == {str(rank): every_step for rank in range(8)}
    expect(page.locator("#log-rank option")).to_have_count(8)
