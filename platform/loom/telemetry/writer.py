"""Group commit for ingest: one thread per web process writes every batch that is waiting, in one
transaction, while the requests that brought them wait on their futures.

At 1,024 ranks a second, one transaction per batch would spend the server on commits, connections and
the run's seq lock; here a thousand batches cost a handful of transactions. A request is answered only
after its batch is committed, so a rank never drops a batch the platform does not hold.
"""

import asyncio
import logging
import queue
import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from django.db import connection

from .store import IngestResult, PendingBatch, store_batches

log = logging.getLogger(__name__)

IDLE_CLOSE_S = 1.0

Store = Callable[[list[PendingBatch]], list[IngestResult]]


class WriterBusy(Exception):
    """More batches wait than the writer takes: the sender should retry later (HTTP 503)."""


@dataclass(frozen=True)
class LoopWaiter:
    """A request waiting on an event loop: settled, with every other waiter of its loop in the same
    transaction, by one call into that loop."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


Waiter = Future | LoopWaiter


class IngestWriter:
    def __init__(self, store: Store = store_batches, max_per_transaction: int = 1000, max_waiting: int = 8000):
        self._store = store
        self._max_per_transaction = max_per_transaction
        self._max_waiting = max_waiting
        self._queue: queue.SimpleQueue[tuple[PendingBatch, Waiter]] = queue.SimpleQueue()
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, batch: PendingBatch) -> Future:
        """A future of the batch's IngestResult, set once it is committed (or of the error that stopped it)."""
        future: Future = Future()
        self._enqueue(batch, future)
        return future

    def submit_from_loop(self, batch: PendingBatch) -> asyncio.Future:
        """submit() for a caller on an event loop. asyncio.wrap_future would give each request a chain of
        callbacks and a wake-up of the loop of its own (~30 µs of CPU, a thousand times a second); here a
        transaction's requests on one loop are settled by one call into it."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._enqueue(batch, LoopWaiter(loop, future))
        return future

    def waiting(self) -> int:
        """Batches queued and not yet taken into a transaction."""
        return self._queue.qsize()

    def _enqueue(self, batch: PendingBatch, waiter: Waiter) -> None:
        if self.waiting() >= self._max_waiting:
            raise WriterBusy(f"{self._max_waiting} batches are waiting to be written")
        self._queue.put((batch, waiter))
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="loom-ingest-writer", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            try:
                waiting = [self._queue.get(timeout=IDLE_CLOSE_S)]
            except queue.Empty:
                # Quiet: give the connection back rather than hold it (and the database) open for good.
                connection.close()
                continue
            while len(waiting) < self._max_per_transaction:
                try:
                    waiting.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._write(waiting)

    def _write(self, waiting: list[tuple[PendingBatch, Waiter]]) -> None:
        try:
            results = self._store([batch for batch, _ in waiting])
        except Exception:
            # One bad batch must not fail the others, and a broken connection (the database restarted)
            # is replaced: each batch is tried again on its own, on a fresh connection.
            log.exception("writing %d batches together failed; writing them one by one", len(waiting))
            connection.close()
            _settle([(waiter, self._write_alone(batch)) for batch, waiter in waiting])
            return
        _settle([(waiter, result) for (_, waiter), result in zip(waiting, results, strict=True)])

    def _write_alone(self, batch: PendingBatch) -> IngestResult | Exception:
        try:
            (result,) = self._store([batch])
        except Exception as error:
            connection.close()
            return error
        return result


def _settle(outcomes: list[tuple[Waiter, IngestResult | Exception]]) -> None:
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, IngestResult | Exception]]] = defaultdict(list)
    for waiter, outcome in outcomes:
        if isinstance(waiter, LoopWaiter):
            by_loop[waiter.loop].append((waiter.future, outcome))
        else:
            _resolve(waiter, outcome)
    for loop, settled in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle_on_loop, settled)
        except RuntimeError:
            # The loop has closed (its server stopped): nobody waits for these answers any more.
            log.warning("%d ingest answers dropped: their event loop is closed", len(settled))


def _settle_on_loop(settled: list[tuple[asyncio.Future, IngestResult | Exception]]) -> None:
    for future, outcome in settled:
        # A request whose client went away was cancelled; its batch is stored all the same.
        if not future.done():
            _resolve(future, outcome)


def _resolve(future: Future | asyncio.Future, outcome: IngestResult | Exception) -> None:
    if isinstance(outcome, Exception):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


# One per web process.
writer = IngestWriter()
