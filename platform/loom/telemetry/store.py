"""Writing ingested batches: any number of ranks' batches in one transaction.

Each batch is claimed once by its (attempt, rank, seq) key, its events take the run's next seq numbers
(one UPDATE … RETURNING per run and transaction, not a row lock per batch), and `metric` and `heartbeat`
events are projected into the tables the charts read (RankStep, RankTile, RankStatus). The group
commit in writer.py calls this with whatever batches arrived together; a single batch is a list of one.
"""

import logging
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import groupby

from django.db import connection, transaction
from django.utils import timezone

from loom.checkpoints.services import record_checkpoint_event
from loom.runs import services as run_services
from loom.runs.models import Attempt

from .models import Event, IngestBatch, RankStatus, RankStep, RankTile, wire
from .publish import publish

log = logging.getLogger(__name__)

LAUNCHER_RANK = -1
# A tile sums this many consecutive steps of one rank; a chart picks the coarsest that still gives
# it enough columns (queries.py). Powers of 8 keep every level within 8× of the width asked for.
TILE_SPANS = (8, 64, 512, 4096)
# Rows per INSERT statement: well under SQLite's 32,766 bound variables.
ROWS_PER_STATEMENT = 400


@dataclass(frozen=True)
class PendingBatch:
    """A validated batch: events are {kind, time, step, payload} dicts in the order the rank sent them."""

    attempt_id: int
    attempt_number: int
    run_id: int
    rank: int
    seq: int
    events: list[dict]

    @property
    def key(self) -> tuple[int, int, int]:
        return self.attempt_id, self.rank, self.seq


@dataclass(frozen=True)
class IngestResult:
    stored: int
    duplicate: bool


def store_batches(batches: list[PendingBatch]) -> list[IngestResult]:
    """Store every batch not stored before, all or nothing; answers in the order given."""
    with transaction.atomic():
        fresh = _claim(batches)
        new = [batch for batch, is_new in zip(batches, fresh, strict=True) if is_new]
        events = _append(new)
        _project(events)
        _apply_special(events)
    return [
        IngestResult(stored=len(batch.events), duplicate=False) if is_new else IngestResult(stored=0, duplicate=True)
        for batch, is_new in zip(batches, fresh, strict=True)
    ]


def _claim(batches: list[PendingBatch]) -> list[bool]:
    """Insert each batch's key unless it is there already; True for the batches this call claimed.
    A key twice in one call (a retry racing its original) is claimed by the first."""
    first_of_key: dict[tuple[int, int, int], int] = {}
    for index, batch in enumerate(batches):
        first_of_key.setdefault(batch.key, index)
    now = connection.ops.adapt_datetimefield_value(timezone.now())
    claimed: set[tuple[int, int, int]] = set()
    table = IngestBatch._meta.db_table
    keys = [batches[index] for index in first_of_key.values()]
    with connection.cursor() as cursor:
        for chunk in _chunks(keys):
            values = ", ".join(["(%s, %s, %s, %s, %s)"] * len(chunk))
            params = [p for b in chunk for p in (b.attempt_id, b.rank, b.seq, len(b.events), now)]
            cursor.execute(
                f"INSERT INTO {table} (attempt_id, rank, seq, event_count, received_at) VALUES {values} "
                "ON CONFLICT (attempt_id, rank, seq) DO NOTHING RETURNING attempt_id, rank, seq",
                params,
            )
            claimed.update(tuple(row) for row in cursor.fetchall())
    return [first_of_key[batch.key] == index and batch.key in claimed for index, batch in enumerate(batches)]


@dataclass
class StoredEvent:
    batch: PendingBatch
    row: Event


def _append(batches: list[PendingBatch]) -> list[StoredEvent]:
    """Give the events the next seq numbers of their runs (in run id order, so two writers never wait
    on each other's runs crosswise) and insert them; publish them once the transaction commits."""
    stored: list[StoredEvent] = []
    by_run = sorted(batches, key=lambda batch: batch.run_id)
    for run_id, group in groupby(by_run, key=lambda batch: batch.run_id):
        run_batches = [batch for batch in group if batch.events]
        count = sum(len(batch.events) for batch in run_batches)
        if not count:
            continue
        seq = reserve_seqs(run_id, count) - count
        for batch in run_batches:
            for item in batch.events:
                seq += 1
                row = Event(
                    run_id=run_id,
                    seq=seq,
                    attempt_id=batch.attempt_id,
                    kind=item["kind"],
                    rank=batch.rank,
                    step=item.get("step"),
                    payload=item.get("payload") or {},
                    time=datetime.fromtimestamp(item["time"], UTC),
                )
                stored.append(StoredEvent(batch, row))
    Event.objects.bulk_create([event.row for event in stored], batch_size=ROWS_PER_STATEMENT)
    wire_by_run: dict[int, list[dict]] = defaultdict(list)
    for event in stored:
        wire_by_run[event.row.run_id].append(wire(event.row, event.batch.attempt_number))
    for run_id, wire_events in wire_by_run.items():
        transaction.on_commit(lambda run_id=run_id, wire_events=wire_events: publish(run_id, wire_events))
    return stored


def reserve_seqs(run_id: int, count: int) -> int:
    """Add `count` to the run's last seq and return the new last seq. The row stays locked until the
    transaction ends, which is what keeps a run's seq numbers in commit order."""
    with connection.cursor() as cursor:
        cursor.execute("UPDATE runs_run SET last_seq = last_seq + %s WHERE id = %s RETURNING last_seq", [count, run_id])
        return cursor.fetchone()[0]


# ---- projections for the charts ----


def _number(value) -> float | None:
    """A finite number from a payload; non-finite ones travel as strings ("NaN") and are no point on a chart."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if value == value and abs(value) != float("inf") else None


def _whole(value) -> int | None:
    number = _number(value)
    return int(number) if number is not None else None


def rank_step_row(run_id: int, attempt_id: int, rank: int, step: int, time: datetime, payload: dict) -> RankStep:
    memory = payload.get("memory_allocated", payload.get("memory_rss"))
    memory_peak = payload.get("memory_peak", payload.get("memory_peak_rss"))
    return RankStep(
        run_id=run_id,
        attempt_id=attempt_id,
        rank=rank,
        step=step,
        time=time,
        loss=_number(payload.get("loss")),
        loss_mean=_number(payload.get("loss_mean")),
        grad_norm=_number(payload.get("grad_norm")),
        lr=_number(payload.get("lr")),
        step_time_s=_number(payload.get("step_time_s")),
        tokens_per_s=_number(payload.get("tokens_per_s")),
        mfu=_number(payload.get("mfu")),
        memory_bytes=_whole(memory),
        memory_peak_bytes=_whole(memory_peak),
    )


def _project(events: list[StoredEvent]) -> None:
    steps = [
        rank_step_row(e.row.run_id, e.row.attempt_id, e.row.rank, e.row.step, e.row.time, e.row.payload)
        for e in events
        if e.row.kind == "metric" and e.row.step is not None and e.row.rank is not None and e.row.rank >= 0
    ]
    RankStep.objects.bulk_create(steps, batch_size=ROWS_PER_STATEMENT, ignore_conflicts=True)
    _add_to_tiles(steps)
    _record_heartbeats([e.row for e in events if e.row.kind == "heartbeat" and e.row.rank is not None])


class _TileSum:
    __slots__ = ("count", "time_sum", "time_min", "time_max", "memory_sum", "memory_min", "memory_max")

    def __init__(self):
        self.count = 0
        self.time_sum = self.time_min = self.time_max = None
        self.memory_sum = self.memory_min = self.memory_max = None

    def add(self, step_time: float | None, memory: int | None) -> None:
        self.count += 1
        if step_time is not None:
            self.time_sum = (self.time_sum or 0.0) + step_time
            self.time_min = step_time if self.time_min is None else min(self.time_min, step_time)
            self.time_max = step_time if self.time_max is None else max(self.time_max, step_time)
        if memory is not None:
            self.memory_sum = (self.memory_sum or 0.0) + memory
            self.memory_min = memory if self.memory_min is None else min(self.memory_min, memory)
            self.memory_max = memory if self.memory_max is None else max(self.memory_max, memory)

    def values(self) -> tuple:
        return (
            self.count,
            self.time_sum,
            self.time_min,
            self.time_max,
            self.memory_sum,
            self.memory_min,
            self.memory_max,
        )


def _add_to_tiles(steps: list[RankStep]) -> None:
    """Fold the steps into every tile level: summed in Python first (one statement may not update a
    row twice), then added to what each tile holds."""
    tiles: dict[tuple[int, int, int, int], _TileSum] = defaultdict(_TileSum)
    for row in steps:
        for span in TILE_SPANS:
            tiles[(row.attempt_id, span, row.step // span, row.rank)].add(row.step_time_s, row.memory_bytes)
    if not tiles:
        return
    table = RankTile._meta.db_table
    least, greatest = ("LEAST", "GREATEST") if connection.vendor == "postgresql" else ("MIN", "MAX")

    def combined(column: str, how: str) -> str:
        # Both backends: NULL + x is NULL, and SQLite's two-argument MIN/MAX are NULL when either is.
        current, new = f"{table}.{column}", f"excluded.{column}"
        joined = f"{current} + {new}" if how == "sum" else f"{how}({current}, {new})"
        return f"{column} = COALESCE({joined}, {current}, {new})"

    updates = ", ".join(
        [
            f"count = {table}.count + excluded.count",
            combined("step_time_sum", "sum"),
            combined("step_time_min", least),
            combined("step_time_max", greatest),
            combined("memory_sum", "sum"),
            combined("memory_min", least),
            combined("memory_max", greatest),
        ]
    )
    rows = [(*key, *tile.values()) for key, tile in sorted(tiles.items())]
    columns = (
        "attempt_id, span, bucket, rank, count, step_time_sum, step_time_min, step_time_max, "
        "memory_sum, memory_min, memory_max"
    )
    with connection.cursor() as cursor:
        for chunk in _chunks(rows, ROWS_PER_STATEMENT // 4):
            values = ", ".join(["(" + ", ".join(["%s"] * len(chunk[0])) + ")"] * len(chunk))
            cursor.execute(
                f"INSERT INTO {table} ({columns}) VALUES {values} "
                f"ON CONFLICT (attempt_id, span, bucket, rank) DO UPDATE SET {updates}",
                [value for row in chunk for value in row],
            )


def _record_heartbeats(heartbeats: list[Event]) -> None:
    latest: dict[tuple[int, int], Event] = {}
    for event in heartbeats:
        key = (event.attempt_id, event.rank)
        if key not in latest or latest[key].time <= event.time:
            latest[key] = event
    if not latest:
        return
    table = RankStatus._meta.db_table
    rows = [
        (
            event.attempt_id,
            event.rank,
            str(event.payload.get("host") or "")[:255],
            _whole(event.payload.get("pid")),
            connection.ops.adapt_datetimefield_value(event.time),
            event.step,
        )
        for _, event in sorted(latest.items())
    ]
    with connection.cursor() as cursor:
        for chunk in _chunks(rows):
            values = ", ".join(["(%s, %s, %s, %s, %s, %s)"] * len(chunk))
            cursor.execute(
                f"INSERT INTO {table} (attempt_id, rank, host, pid, last_heartbeat, last_step) VALUES {values} "
                "ON CONFLICT (attempt_id, rank) DO UPDATE SET host = excluded.host, pid = excluded.pid, "
                "last_heartbeat = excluded.last_heartbeat, "
                f"last_step = COALESCE(excluded.last_step, {table}.last_step)",
                [value for row in chunk for value in row],
            )


def _apply_special(events: list[StoredEvent]) -> None:
    """Checkpoint events fill the lineage and the launcher's state events move the attempt, in the same
    transaction as the events themselves."""
    special = [
        event
        for event in events
        if event.row.kind == "checkpoint" or (event.row.kind == "state" and event.row.rank == LAUNCHER_RANK)
    ]
    if not special:
        return
    attempts = Attempt.objects.select_related("run").in_bulk({event.row.attempt_id for event in special})
    for event in special:
        attempt = attempts[event.row.attempt_id]
        if event.row.kind == "checkpoint":
            record_checkpoint_event(attempt, event.row)
        else:
            _apply_launcher_state(attempt, event.row.payload)
            attempt.refresh_from_db()


def _apply_launcher_state(attempt: Attempt, payload: dict) -> None:
    target = payload.get("state")
    if target == attempt.state:
        return
    try:
        run_services.move_attempt(
            attempt,
            target,
            exit_code=payload.get("exit_code"),
            reason=payload.get("reason", ""),
            failure_kind=payload.get("failure_kind", ""),
            retryable=payload.get("retryable"),
        )
    except ValueError as error:
        log.warning("launcher reported state %r for %s, kept %s: %s", target, attempt, attempt.state, error)


def _chunks(items: list, size: int = ROWS_PER_STATEMENT // 5):
    for start in range(0, len(items), size):
        yield items[start : start + size]
