"""Per-rank telemetry: events are queued, cut into numbered batches, spooled to disk, then POSTed in order.

The spool is the source of truth. A batch reaches disk before its first send and leaves it only
once the platform has stored it (or refused it for good, in which case it moves to rejected/), so
a platform, database or network outage loses nothing: the batches wait and are retried with
backoff, and whatever is still spooled when a rank exits can be sent later by deliver_spool().
The server stores each (attempt, rank, seq) once, so re-sending a batch is always safe.

Wire contract: POST {url}/api/ingest with a bearer token and the body
{"attempt": int, "rank": int, "seq": int, "events": [{"kind", "time", "step", "payload"}]}.
Retention asks with the same token: GET {url}/api/checkpoints/pinned answers {"pinned": {path: [why, …]}}.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.ingest_connection import Delivery, IngestConnection

EVENT_KINDS = frozenset({"metric", "heartbeat", "comm", "log", "checkpoint", "state"})
# The platform refuses bodies over 1 MiB or 5000 events; staying well under leaves headroom.
MAX_BATCH_EVENTS = 2000
MAX_BATCH_BYTES = 512 * 1024
# One enormous record (a dumped tensor, say) must not crowd a batch towards the platform's size limit.
MAX_LOG_MESSAGE_CHARS = 64 * 1024
BACKOFF_START_S = 0.25
BACKOFF_CAP_S = 5.0
REQUEST_TIMEOUT_S = 10.0
# Below this a request cannot even finish connecting; close() gives each send at least this long.
MIN_REQUEST_TIMEOUT_S = 0.1

BATCH_FILE = re.compile(r"^(\d{10})\.json$")
RANK_DIR = re.compile(r"^rank(-?\d+)$")
NEXT_SEQ_FILE = "next_seq"
REJECTED_DIR = "rejected"


def encode_event(kind: str, payload: dict[str, Any], step: int | None, emitted_at: float) -> str:
    """One event as compact JSON. Non-finite floats become "NaN"/"Infinity"/"-Infinity" strings:
    bare NaN is not JSON, and a diverging loss is exactly what must still reach the platform."""
    event = {"kind": kind, "time": emitted_at, "step": step, "payload": payload}
    try:
        return json.dumps(event, separators=(",", ":"), allow_nan=False)
    except ValueError:
        return json.dumps(_finite_json(event), separators=(",", ":"), allow_nan=False)


def _finite_json(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: _finite_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_json(item) for item in value]
    return value


def split_batches(events: list[str]) -> Iterator[list[str]]:
    """Group encoded events into batches within MAX_BATCH_EVENTS and MAX_BATCH_BYTES."""
    batch: list[str] = []
    size = 0
    for event in events:
        if batch and (len(batch) >= MAX_BATCH_EVENTS or size + len(event) + 1 > MAX_BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(event)
        size += len(event) + 1
    if batch:
        yield batch


def batch_body(attempt: int | None, rank: int, seq: int, events: list[str]) -> bytes:
    head = json.dumps({"attempt": attempt, "rank": rank, "seq": seq}, separators=(",", ":"))[:-1]
    return f'{head},"events":[{",".join(events)}]}}'.encode()


def write_atomically(path: Path, data: bytes) -> None:
    """Readers see the old file or the whole new one, never a partial write."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def spooled_batches(rank_dir: Path) -> list[Path]:
    """The batch files of one rank, lowest seq first."""
    if not rank_dir.is_dir():
        return []
    return sorted(path for path in rank_dir.iterdir() if BATCH_FILE.match(path.name))


def rank_dirs(spool_dir: Path) -> list[Path]:
    """The per-rank spool directories (rank-1 is the launcher's), by rank."""
    directories = [path for path in Path(spool_dir).glob("rank*") if path.is_dir() and RANK_DIR.match(path.name)]
    return sorted(directories, key=lambda path: int(RANK_DIR.match(path.name)[1]))


def read_spool(spool_dir: Path) -> list[dict[str, Any]]:
    """Every batch still spooled, for all ranks, sorted by (rank, seq)."""
    batches = [
        json.loads(path.read_bytes()) for directory in rank_dirs(spool_dir) for path in spooled_batches(directory)
    ]
    return sorted(batches, key=lambda batch: (batch["rank"], batch["seq"]))


class PlatformUnreachable(Exception):
    """The platform could not answer a question the trainer asked it; the message says why."""


@dataclass(frozen=True)
class Pins:
    """What the platform says retention must keep: the run's pinned checkpoints (path → why), and the last step
    its alerts have judged (None: it judges none, alerts are off or there is no platform). An alert yet to open
    for a later step would pin the checkpoint before that step, so those are kept until it has judged them."""

    paths: dict[str, list[str]]
    judged_through: int | None = None


def fetch_pinned(url: str, token: str, timeout_s: float) -> Pins:
    """The run's pinned checkpoints, by path, with why each is pinned, and how far its alerts have judged."""
    request = urllib.request.Request(
        f"{url.rstrip('/')}/api/checkpoints/pinned",
        headers={"Accept": "application/json", "Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            answer = json.loads(response.read())
    except (OSError, ValueError) as error:
        raise PlatformUnreachable(f"asking {request.full_url}: {type(error).__name__}: {error}") from None
    pinned = answer.get("pinned") if isinstance(answer, dict) else None
    if not isinstance(pinned, dict):
        raise PlatformUnreachable(f"{request.full_url} answered without a map of pinned checkpoints")
    judged_through = answer.get("judged_through")
    return Pins(pinned, judged_through if isinstance(judged_through, int) else None)


def backoff_delay(failures: int) -> float:
    """Exponential from BACKOFF_START_S, capped at BACKOFF_CAP_S, jittered so ranks do not retry in lockstep."""
    ceiling = min(BACKOFF_CAP_S, BACKOFF_START_S * 2 ** max(failures - 1, 0))
    return random.uniform(ceiling / 2, ceiling)


def set_aside_count(spool_dir: Path) -> int:
    """How many batches the platform refused for good, kept in the spool's rejected/ folder."""
    return sum(1 for _ in (Path(spool_dir) / REJECTED_DIR).glob("*.json"))


class _Courier:
    """Sends the oldest spooled batch of a rank directory and files it by the outcome. A batch refused for
    good (any client error but 408 and 429) moves to rejected/, so the next one goes: a batch the platform
    will never take must not hold back every later batch of its rank."""

    def __init__(self, spool_dir: Path, url: str, token: str):
        self.spool_dir = Path(spool_dir)
        self.connection = IngestConnection(url, token)
        self.failures = 0

    def send_oldest(self, rank_dir: Path, timeout_s: float) -> Delivery | None:
        """None when the directory holds no batch."""
        batches = spooled_batches(rank_dir)
        if not batches:
            return None
        path = batches[0]
        outcome, detail = self.connection.post(path.read_bytes(), timeout_s)
        if outcome is Delivery.DELIVERED:
            path.unlink()
            self.failures = 0
        elif outcome is Delivery.REJECTED:
            self._reject(rank_dir, path, detail)
        else:
            if self.failures == 0:
                _report(f"cannot deliver {rank_dir.name}/{path.name} ({detail}); keeping it spooled and retrying")
            self.failures += 1
        return outcome

    def _reject(self, rank_dir: Path, path: Path, detail: str) -> None:
        rejected_dir = self.spool_dir / REJECTED_DIR
        rejected_dir.mkdir(parents=True, exist_ok=True)
        destination = rejected_dir / f"{rank_dir.name}-{path.name}"
        os.replace(path, destination)
        _report(f"the platform refused {rank_dir.name}/{path.name} ({detail}); moved it to {destination}")


def _report(message: str) -> None:
    print(f"loom telemetry: {message}", file=sys.stderr, flush=True)


def deliver_spool(spool_dir: Path, url: str, token: str, deadline_s: float) -> int:
    """Send every spooled batch of every rank, each rank in seq order, trying for at most
    deadline_s seconds; returns how many batches are still spooled."""
    deadline = time.monotonic() + deadline_s
    courier = _Courier(spool_dir, url, token)
    try:
        for rank_dir in rank_dirs(spool_dir):
            while (remaining := deadline - time.monotonic()) > 0:
                timeout_s = max(MIN_REQUEST_TIMEOUT_S, min(REQUEST_TIMEOUT_S, remaining))
                outcome = courier.send_oldest(rank_dir, timeout_s)
                if outcome is None:
                    break
                if outcome is Delivery.RETRY:
                    time.sleep(max(0.0, min(backoff_delay(courier.failures), deadline - time.monotonic())))
    finally:
        courier.connection.close()
    return sum(len(spooled_batches(rank_dir)) for rank_dir in rank_dirs(spool_dir))


class TelemetryClient:
    """Queues events from any thread; background threads spool them in numbered batches and deliver them.

    With url=None nothing is sent: the spool on disk is the whole record (used offline and by tests).
    """

    def __init__(
        self,
        url: str | None,
        token: str | None,
        attempt: int | None,
        rank: int,
        spool_dir: Path,
        flush_interval_s: float,
        heartbeat_interval_s: float | None,
    ):
        if url is not None and (token is None or attempt is None):
            raise ValueError("a telemetry url needs a token and an attempt number to send with it")
        self.url = url
        self._token = token
        self.attempt = attempt
        self.rank = rank
        self.spool_dir = Path(spool_dir)
        self.rank_dir = self.spool_dir / f"rank{rank}"
        self.rank_dir.mkdir(parents=True, exist_ok=True)
        self.flush_interval_s = flush_interval_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self._next_seq = self._first_unused_seq()
        self._pending: list[str] = []
        self._oldest_pending_at = 0.0
        self._metric_pending = False
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._last_step: int | None = None
        # Called by the heartbeat thread: what else each heartbeat carries (the collective progress).
        self.heartbeat_details: Callable[[], dict | None] = lambda: None
        self._closing = threading.Event()
        self._spooled = threading.Event()
        self._spooler_done = threading.Event()
        self._deadline: float | None = None
        self._courier = _Courier(self.spool_dir, url, token) if url is not None else None
        loops = [("spool", self._spool_loop)]
        if self._courier is not None:
            loops.append(("send", self._send_loop))
        if heartbeat_interval_s is not None:
            loops.append(("heartbeat", self._heartbeat_loop))
        self._threads = [
            threading.Thread(target=loop, name=f"telemetry-{role}-rank{rank}", daemon=True) for role, loop in loops
        ]
        for thread in self._threads:
            thread.start()

    def _first_unused_seq(self) -> int:
        """After the highest seq ever cut here, so a re-created client never reuses a number
        (the server would take a reused one for a duplicate and drop its events)."""
        highest = max((int(BATCH_FILE.match(path.name)[1]) for path in spooled_batches(self.rank_dir)), default=-1)
        marker = self.rank_dir / NEXT_SEQ_FILE
        recorded = int(marker.read_text()) if marker.exists() else 0
        return max(highest + 1, recorded)

    def emit(self, kind: str, payload: dict[str, Any], step: int | None = None) -> bool:
        """Queue one event; False when the client is already closed and the event was not taken."""
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {kind!r}; expected one of {sorted(EVENT_KINDS)}")
        line = encode_event(kind, payload, step, time.time())
        with self._lock:
            if self._closed:
                return False
            if not self._pending:
                self._oldest_pending_at = time.monotonic()
            self._pending.append(line)
            self._metric_pending |= kind == "metric"
            if step is not None:
                self._last_step = step
        if kind == "metric":
            self._wake.set()
        return True

    def pinned_checkpoints(self, timeout_s: float = REQUEST_TIMEOUT_S) -> Pins:
        """The run's checkpoints that retention must keep, by path, with why, as the platform says now;
        none without a platform (offline). PlatformUnreachable when it cannot be asked."""
        if self.url is None:
            return Pins({})
        return fetch_pinned(self.url, self._token, timeout_s)

    def close(self, timeout_s: float) -> int:
        """Spool what is queued, keep delivering until timeout_s has passed, stop the threads;
        returns how many batches are still spooled (undelivered)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            already_closed = self._closed
            self._closed = True
        if not already_closed:
            self._deadline = deadline
            self._closing.set()
            self._wake.set()
            spooler, *others = self._threads
            # Joined without a limit: what was emitted must reach the disk even when the network cannot be reached.
            spooler.join()
            for thread in others:
                thread.join(max(0.0, deadline - time.monotonic()) + MIN_REQUEST_TIMEOUT_S)
        return len(spooled_batches(self.rank_dir))

    def _spool_loop(self) -> None:
        """Cut at most one batch per flush interval: a step's metrics as soon as the last cut is an interval
        old (at once when steps are slower than the interval, so a point is on its way when it is made),
        anything else once it has waited an interval."""
        last_cut = -math.inf
        while not self._closing.is_set():
            wait = self._next_cut(last_cut) - time.monotonic()
            if wait > 0:
                # A metric queued meanwhile can bring the cut forward; close() ends the wait too.
                self._wake.wait(wait)
                self._wake.clear()
                continue
            self._cut_batches()
            last_cut = time.monotonic()
        self._cut_batches()
        self._spooler_done.set()
        self._spooled.set()

    def _next_cut(self, last_cut: float) -> float:
        with self._lock:
            if not self._pending:
                return time.monotonic() + self.flush_interval_s
            due = self._oldest_pending_at + self.flush_interval_s
            if self._metric_pending:
                due = min(due, last_cut + self.flush_interval_s)
        return due

    def _cut_batches(self) -> None:
        with self._lock:
            events, self._pending = self._pending, []
            self._metric_pending = False
        if not events:
            return
        for batch in split_batches(events):
            seq = self._next_seq
            self._next_seq += 1
            write_atomically(self.rank_dir / f"{seq:010d}.json", batch_body(self.attempt, self.rank, seq, batch))
        write_atomically(self.rank_dir / NEXT_SEQ_FILE, str(self._next_seq).encode())
        self._spooled.set()

    def _send_loop(self) -> None:
        try:
            self._deliver_until_done()
        finally:
            self._courier.connection.close()

    def _deliver_until_done(self) -> None:
        while True:
            deadline = self._deadline
            if deadline is not None and time.monotonic() >= deadline:
                return
            request_timeout = REQUEST_TIMEOUT_S
            if deadline is not None:
                request_timeout = max(MIN_REQUEST_TIMEOUT_S, min(REQUEST_TIMEOUT_S, deadline - time.monotonic()))
            outcome = self._courier.send_oldest(self.rank_dir, request_timeout)
            if outcome is None:
                if self._spooler_done.is_set():
                    return
                self._spooled.wait(self.flush_interval_s)
                self._spooled.clear()
            elif outcome is Delivery.RETRY:
                self._pause(backoff_delay(self._courier.failures))

    def _pause(self, delay: float) -> None:
        """Back off; close() cuts a running pause short once, then pauses end at its deadline."""
        if not self._closing.is_set():
            self._closing.wait(delay)
            return
        time.sleep(max(0.0, min(delay, self._deadline - time.monotonic())))

    def _heartbeat_loop(self) -> None:
        identity = {"pid": os.getpid(), "host": socket.gethostname()}
        while True:
            collectives = self.heartbeat_details()
            extra = {"collectives": collectives} if collectives is not None else {}
            self.emit("heartbeat", identity | extra, step=self._last_step)
            if self._closing.wait(self.heartbeat_interval_s):
                return


class TelemetryLogHandler(logging.Handler):
    """Turns log records into `log` events {level, message, logger}; a record's `step` extra is kept."""

    def __init__(self, client: TelemetryClient, level: int = logging.INFO):
        super().__init__(level)
        self.client = client

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            if (excess := len(message) - MAX_LOG_MESSAGE_CHARS) > 0:
                message = f"{message[:MAX_LOG_MESSAGE_CHARS]}\n[{excess} more characters truncated]"
            payload = {"level": record.levelname, "message": message, "logger": record.name}
            self.client.emit("log", payload, step=getattr(record, "step", None))
        except Exception:
            self.handleError(record)
