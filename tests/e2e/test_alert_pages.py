"""In a real Chromium, against the real worker and trainer: one rank slowed by fault injection, the
straggler toast appears on the page the user has open, its link opens triage naming and highlighting
that rank, and Restore from the offered checkpoint starts the run's next attempt from it. (The page's
event loop owns this thread, so the test reads the platform through its API, as the page does.)"""

import time

import pytest
from playwright.sync_api import expect

from loom.alerts import detectors

from ..platform.helpers import TINY_CONFIG

pytestmark = pytest.mark.e2e

VIEWPORT = {"width": 1280, "height": 1000}
SLOW_RANK = 2
STRAGGLER_CONFIG = {
    **TINY_CONFIG,
    "steps": 14,
    "parallel": {"dp_replicate": 4},
    "checkpoint": {"interval_steps": 2, "keep_last": 10},
    # A run of seconds: its slowed rank is judged without the 10 s floor (tests/platform/test_alerts.py has it).
    "alerts": {"straggler_min_s": 0.0},
    "faults": {"slow_rank": SLOW_RANK, "slow_ms": 300},
}
TOAST_TIMEOUT_MS = 180_000
RUN_END_TIMEOUT_S = 120

API = """async ([method, path, body]) => {
  const response = method === "GET" ? await fetch(path) : await window.loom.post(path, body);
  return [response.status, await response.json()];
}"""


def api(page, method: str, path: str, body=None):
    return page.evaluate(API, [method, path, body])


def test_a_straggler_toast_leads_to_triage_and_a_restore(live_platform, open_logged_in):
    page = open_logged_in("/", VIEWPORT)
    page.wait_for_function("window.loomAlerts && window.loomAlerts.opened === 1")
    status, run = api(page, "POST", "/api/runs", {"name": "slowed", "config": STRAGGLER_CONFIG})
    assert status == 201, run

    toast = page.locator(f'.toast[data-rule="{detectors.STRAGGLER}"]')
    expect(toast).to_be_visible(timeout=TOAST_TIMEOUT_MS)
    expect(toast).to_contain_text(f"rank {SLOW_RANK}")
    expect(toast.locator("a")).to_have_text("slowed: triage")
    toast.locator("a").click()
    page.wait_for_url(f"**/runs/{run['id']}/triage/#alert-*")

    # A restore becomes the run's next attempt once this one has ended.
    deadline = time.monotonic() + RUN_END_TIMEOUT_S
    while api(page, "GET", f"/api/runs/{run['id']}")[1]["state"] not in ("succeeded", "failed"):
        assert time.monotonic() < deadline, "the run did not end"
        page.wait_for_timeout(1000)
    page.reload()
    (alert,) = api(page, "GET", f"/api/runs/{run['id']}/alerts")[1]
    assert (alert["rule"], alert["rank"]) == (detectors.STRAGGLER, SLOW_RANK)
    # The slow rank heads the suspects, highlighted; its alert names it and its node.
    top = page.locator(".top-suspect")
    expect(top).to_have_attribute("data-suspect", f"rank {SLOW_RANK}")
    assert page.evaluate("getComputedStyle(document.querySelector('.top-suspect td')).fontWeight") == "700"
    card = page.locator(f"#alert-{alert['id']}")
    expect(card.locator(".alert-rank")).to_have_text(f"rank {SLOW_RANK} on {alert['host']}")
    expect(card.locator(".alert-log").first).to_contain_text(f"rank {SLOW_RANK} step {alert['step']}/")
    # Beside it, the heatmap of that moment: the slow rank's own work is the darkest row, and outlined.
    page.wait_for_function(f"window.loomTriage && window.loomTriage.drawn[{alert['id']}]")
    drawn = page.evaluate(f"window.loomTriage.drawn[{alert['id']}]")
    assert drawn["curves"] == 2 and drawn["ranks"] == [SLOW_RANK] and drawn["heatmap"]["metric"] == "compute_s"
    means = [
        sum(v for v in row if v is not None) / max(1, sum(v is not None for v in row)) for row in drawn["heatmap"]["z"]
    ]
    assert max(range(len(means)), key=means.__getitem__) == SLOW_RANK
    assert alert["step"] in drawn["heatmap"]["steps"]
    # Ticked on whole ranks only (Plotly's own ticks for 4 ranks fall on halves), no zero line across rank 0.
    heatmap = f"#alert-{alert['id']} .alert-heatmap"
    rank_ticks = page.evaluate(
        f"[...document.querySelectorAll('{heatmap} .ytick text')].map((tick) => tick.textContent)"
    )
    assert sorted(rank_ticks) == ["0", "1", "2", "3"]
    zero_lines = (
        f"(({{ xaxis, yaxis }}) => [xaxis.zeroline, yaxis.zeroline])(document.querySelector('{heatmap}')._fullLayout)"
    )
    assert page.evaluate(zero_lines) == [False, False]

    # The checkpoint offered is the last committed before the alert's step.
    checkpoints = api(page, "GET", f"/api/runs/{run['id']}/checkpoints")[1]
    offered = max(
        (item for item in checkpoints if item["step"] < alert["step"] and item["state"] == "committed"),
        key=lambda item: item["step"],
    )
    restore = card.locator("button.restore")
    expect(restore).to_have_attribute("data-checkpoint", str(offered["id"]))
    restore.click()
    page.wait_for_url(f"**/runs/{run['id']}/")
    attempts = {attempt["number"]: attempt for attempt in api(page, "GET", f"/api/runs/{run['id']}")[1]["attempts"]}
    assert attempts[2]["trigger"] == "restore" and attempts[2]["restored_from"] == offered["id"]
