"""Group commit for ingest: one thread per web process writes every batch that is waiting, in one
transaction, while the requests that brought them wait on their futures.

At 1,024 ranks a second, one transaction per batch would spend the server on commits, connections and
the run's seq lock; here a thousand batches cost a handful of transactions. A request is answered only
after its batch is committed, so a rank never drops a batch the platform does not hold.
"""

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from django.db import connection

from .store import IngestResult, PendingBatch, store_batches

log = logging.getLogger(__name__)

IDLE_CLOSE_S = 1.0

Store = Callable[[list[PendingBatch]], list[IngestResult]]


class WriterBusy(Exception):
    """More batches wait than the writer takes: the sender should retry later (HTTP 503)."""


class IngestWriter:
    def __init__(self, store: Store = store_batches, max_per_transaction: int = 1000, max_waiting: int = 8000):
        self._store = store
        self._max_per_transaction = max_per_transaction
        self._max_waiting = max_waiting
        self._queue: queue.SimpleQueue[tuple[PendingBatch, Future]] = queue.SimpleQueue()
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, batch: PendingBatch) -> Future:
        """A future of the batch's IngestResult, set once it is committed (or of the error that stopped it)."""
        if self._queue.qsize() >= self._max_waiting:
            raise WriterBusy(f"{self._max_waiting} batches are waiting to be written")
        future: Future = Future()
        self._queue.put((batch, future))
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="loom-ingest-writer", daemon=True)
                self._thread.start()
        return future

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

    def _write(self, waiting: list[tuple[PendingBatch, Future]]) -> None:
        try:
            results = self._store([batch for batch, _ in waiting])
        except Exception:
            # One bad batch must not fail the others, and a broken connection (the database restarted)
            # is replaced: each batch is tried again on its own, on a fresh connection.
            log.exception("writing %d batches together failed; writing them one by one", len(waiting))
            connection.close()
            for batch, future in waiting:
                self._write_alone(batch, future)
            return
        for (_, future), result in zip(waiting, results, strict=True):
            future.set_result(result)

    def _write_alone(self, batch: PendingBatch, future: Future) -> None:
        try:
            (result,) = self._store([batch])
        except Exception as error:
            connection.close()
            future.set_exception(error)
        else:
            future.set_result(result)


# One per web process.
writer = IngestWriter()
