"""Fan-out to run pages, coalesced: each process sends a run's group at most one message per interval,
carrying every event stored since the last one, so a 1,024-rank run does not become 1,024 websocket
messages a step (and does not overflow channels_redis' group channels, which drop silently).

The first event after a quiet spell goes out at once; events arriving within the interval wait for
the next send. Events are sent in seq order; anything still lost in the channel layer is repaired by
the page's resync from the REST events API.
"""

import logging
import threading
import time
from collections.abc import Callable

from loom.operations.metrics import SEND_FAILED, fanout_dropped_messages, fanout_events, fanout_messages

log = logging.getLogger(__name__)

Send = Callable[[int, list[dict]], None]


class Coalescer:
    def __init__(self, send: Send, interval_s: float):
        self._send = send
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._pending: dict[int, list[dict]] = {}
        self._has_work = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_flush = float("-inf")

    def add(self, run_id: int, events: list[dict]) -> None:
        with self._lock:
            self._pending.setdefault(run_id, []).extend(events)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="loom-fanout", daemon=True)
                self._thread.start()
        self._has_work.set()

    def flush(self) -> None:
        """Send everything pending now, one message per run."""
        with self._lock:
            pending, self._pending = self._pending, {}
            self._has_work.clear()
        self._last_flush = time.monotonic()
        for run_id, events in pending.items():
            events.sort(key=lambda event: event["seq"])
            fanout_events.inc(len(events))
            try:
                self._send(run_id, events)
            except Exception:
                fanout_dropped_messages.labels(SEND_FAILED).inc()
                log.exception("fan-out of %d events for run %s failed; pages will resync", len(events), run_id)
            else:
                fanout_messages.inc()

    def _loop(self) -> None:
        while True:
            self._has_work.wait()
            delay = self._last_flush + self._interval_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            self.flush()
