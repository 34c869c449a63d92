"""The alert watcher beside ingest: it judges an attempt at most once per interval, and spaces its passes
out further when they cost more CPU than its share, whatever they wait on."""

import threading
import time

import pytest

from loom.alerts.evaluate import Pass
from loom.alerts.services import Changes
from loom.alerts.watch import Watcher

from .helpers import claimed_run

PASS_S = 0.02
FEED_S = 1.2


def passes_while_fed(attempt, work) -> list[float]:
    """When each pass started, with metrics noticed every 10 ms for FEED_S; `work` is what a pass does."""
    started = []

    def judge(attempt, reports, judged_through):
        started.append(time.monotonic())
        work()
        return Pass(Changes([], [], []), judged_through)

    watcher = Watcher(0.01, judge=judge, report=lambda attempt, result: None, share_max=0.1)
    deadline = time.monotonic() + FEED_S
    step = 0
    while time.monotonic() < deadline:
        step += 1
        watcher.notice([(attempt.pk, 0, step, {"loss": 1.0})])
        time.sleep(0.01)
    time.sleep(0.3)
    return started


def burn_cpu():
    until = time.thread_time() + PASS_S
    while time.thread_time() < until:
        pass


@pytest.mark.django_db(transaction=True)
def test_passes_that_cost_cpu_are_spaced_out_and_passes_that_wait_are_not(platform_user):
    _, attempt, _ = claimed_run(platform_user[0])
    # 20 ms of CPU a pass against a share of 0.1: a pass every 0.2 s at most, not every 10 ms.
    busy = passes_while_fed(attempt, burn_cpu)
    gaps = [later - earlier for earlier, later in zip(busy, busy[1:], strict=False)]
    assert 3 <= len(busy) <= FEED_S / 0.2 + 2
    assert min(gaps) >= 0.9 * PASS_S / 0.1
    # The same 20 ms spent waiting (on the database, say) costs no CPU: the interval alone spaces them.
    waiting = passes_while_fed(attempt, lambda: threading.Event().wait(PASS_S))
    assert len(waiting) >= 3 * len(busy)
