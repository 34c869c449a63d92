"""Toasts that cannot be lost: in a real Chromium, an alert whose websocket message never arrives (opened
without being announced, as when channels_redis drops a message from a full channel) is still toasted, from
the page's periodic replay; an announced one is toasted once though the replay brings it again; a later page
of the same tab toasts neither again; another user's alert never reaches the page."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connections
from playwright.sync_api import expect

from loom.alerts import detectors, notify
from loom.alerts.detectors import Finding
from loom.alerts.services import record

from ..platform.helpers import claimed_run

pytestmark = pytest.mark.e2e

VIEWPORT = {"width": 1280, "height": 900}
RESYNC_S = 1.0


def in_own_thread(function, *args):
    """The ORM, from a thread with no event loop: the page's loop owns the test's thread."""

    def call():
        try:
            return function(*args)
        finally:
            connections.close_all()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(call).result()


def open_alert(owner, run_name: str, rank: int, announce: bool) -> int:
    _, attempt, _ = claimed_run(owner, run_name)
    finding = Finding(detectors.STRAGGLER, 5, "warning", f"rank {rank} is slow", rank=rank, ranks=(rank,))
    changes = record(attempt, [finding], lambda _: "node-a")
    if announce:
        notify.announce(changes)
    (alert,) = changes.opened
    return alert.pk


def toasts_of(page, alert_id: int):
    return page.locator(f'.toast[data-alert="{alert_id}"]')


def replays(page) -> int:
    return page.evaluate("window.loomAlerts.replays")


def wait_for_replays(page, count: int) -> None:
    page.wait_for_function(f"window.loomAlerts && window.loomAlerts.replays >= {count}")


def test_a_lost_alert_message_is_replayed_and_every_alert_toasted_once(
    platform_user, other_user, settings, open_logged_in
):
    # (The users exist before the browser starts: its event loop then owns this thread.)
    settings.LOOM_ALERTS_RESYNC_S = RESYNC_S
    user = platform_user[0]
    page = open_logged_in("/", VIEWPORT)
    wait_for_replays(page, 1)

    announced = in_own_thread(open_alert, user, "announced", 1, True)
    lost = in_own_thread(open_alert, user, "lost", 2, False)
    someone_elses = in_own_thread(open_alert, other_user, "not yours", 3, True)

    expect(toasts_of(page, announced)).to_have_count(1)
    expect(toasts_of(page, lost)).to_have_count(1, timeout=10_000)
    expect(toasts_of(page, lost)).to_contain_text("rank 2 is slow")
    # Later replays bring both again: still one toast each.
    wait_for_replays(page, replays(page) + 2)
    expect(toasts_of(page, announced)).to_have_count(1)
    expect(toasts_of(page, lost)).to_have_count(1)
    expect(toasts_of(page, someone_elses)).to_have_count(0)

    # The tab's next page replays from where this one left off and shows neither again.
    page.goto("/runs/new/")
    wait_for_replays(page, 2)
    expect(page.locator(".toast")).to_have_count(0)


def test_a_replay_without_a_time_gets_a_field_error(open_logged_in):
    page = open_logged_in("/", VIEWPORT)
    answer = page.evaluate(
        """() => new Promise((resolve) => {
          const socket = new WebSocket(`ws://${location.host}/ws/alerts/`);
          socket.onmessage = (message) => {
            const data = JSON.parse(message.data);
            if (data.type === "hello") socket.send(JSON.stringify({ type: "replay", since: "yesterday" }));
            else { resolve(data); socket.close(); }
          };
        })"""
    )
    assert answer == {"type": "error", "field": "since", "message": "an ISO 8601 time is required"}, json.dumps(answer)
