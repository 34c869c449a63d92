"""Detection as telemetry arrives: ingest tells the watcher which attempts reported metrics (once their
transaction commits), and a thread of its own judges each such attempt at most once per interval, off the
path of the requests that brought them.

A non-finite loss or gradient norm is taken from the events themselves (the tables the charts read keep
only finite values); everything else is read back from those tables by evaluate.py.
"""

import logging
import threading
import time
from collections.abc import Callable, Iterable

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F
from django.db.models.functions import Coalesce, Greatest

from loom.runs.models import Attempt

from .evaluate import Pass, evaluate
from .notify import announce

log = logging.getLogger(__name__)

WATCHED_METRICS = ("loss", "loss_mean", "grad_norm")
IDLE_CLOSE_S = 5.0
# Passes use at most this share of a CPU: the watcher runs beside ingest, whose requests wait while a pass
# holds the interpreter. The pass's own CPU time counts, not its wall time, which waits on the database and,
# on a busy host, on the CPU. A 1,024-rank pass takes tens of ms (benchmarks/alert_pass.py: 53 ms wall), so
# passes there come every second or two; a small run's take a few ms and keep the interval.
PASS_SHARE_MAX = 1 / 50

Judge = Callable[[Attempt, list[tuple[int, int, str, object]], int], Pass]
Report = Callable[[Attempt, Pass], None]


def _log_and_announce(attempt: Attempt, result: Pass) -> None:
    for alert in result.changes.opened:
        log.warning("run %s attempt %s: alert opened: %s", attempt.run_id, attempt.number, alert.message)
    for alert in result.changes.resolved:
        log.info("run %s: alert %s resolved: %s", attempt.run_id, alert.pk, alert.resolution)
    announce(result.changes)


class Watcher:
    def __init__(
        self,
        interval_s: float,
        judge: Judge = evaluate,
        report: Report = _log_and_announce,
        share_max: float = PASS_SHARE_MAX,
    ):
        self._interval_s = interval_s
        self._share_max = share_max
        self._last_pass_cpu_s = 0.0
        self._judge = judge
        self._report = report
        self._lock = threading.Lock()
        self._pending: dict[int, list[tuple[int, int, str, object]]] = {}
        self._judged_through: dict[int, int] = {}
        self._has_work = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_pass = float("-inf")

    def notice(self, metrics: Iterable[tuple[int, int, int | None, dict]]) -> None:
        """(attempt id, rank, step, payload) of metric events just committed."""
        with self._lock:
            for attempt_id, rank, step, payload in metrics:
                reports = self._pending.setdefault(attempt_id, [])
                if step is not None:
                    reports.extend((rank, step, name, payload[name]) for name in WATCHED_METRICS if name in payload)
            if not self._pending:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="loom-alerts", daemon=True)
                self._thread.start()
        self._has_work.set()

    def judge_pending(self) -> None:
        """One pass over every attempt that reported since the last."""
        with self._lock:
            pending, self._pending = self._pending, {}
            self._has_work.clear()
        self._last_pass = time.monotonic()
        started_cpu = time.thread_time()
        try:
            self._judge_each(pending)
        finally:
            self._last_pass_cpu_s = time.thread_time() - started_cpu

    def _judge_each(self, pending: dict[int, list[tuple[int, int, str, object]]]) -> None:
        for attempt_id, reports in pending.items():
            try:
                attempt = Attempt.objects.get(pk=attempt_id)
                result = self._judge(attempt, reports, self._judged_through.get(attempt_id, 0))
            except Exception:
                # The next metrics of the attempt bring it back; a broken connection is replaced then.
                log.exception("judging attempt %s failed", attempt_id)
                connection.close()
                continue
            if result.judged_through > self._judged_through.get(attempt_id, 0):
                # Kept where the trainer's retention asks (GET /api/checkpoints/pinned); the greatest wins, as
                # several web processes may judge one attempt.
                judged = Greatest(Coalesce(F("alerts_judged_through"), 0), result.judged_through)
                Attempt.objects.filter(pk=attempt_id).update(alerts_judged_through=judged)
            self._judged_through[attempt_id] = result.judged_through
            self._report(attempt, result)

    def _loop(self) -> None:
        while True:
            if not self._has_work.wait(timeout=IDLE_CLOSE_S):
                connection.close()
                continue
            spacing = max(self._interval_s, self._last_pass_cpu_s / self._share_max)
            delay = self._last_pass + spacing - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            self.judge_pending()


# One per web process.
watcher = Watcher(settings.LOOM_ALERTS_INTERVAL_S)


def notice_stored_metrics(events, **_) -> None:
    """Receiver of loom.telemetry.store.events_stored: the metrics are judged once their transaction commits."""
    metrics = [
        (event.batch.attempt_id, event.rank, event.step, event.payload) for event in events if event.kind == "metric"
    ]
    if metrics:
        transaction.on_commit(lambda: watcher.notice(metrics))
