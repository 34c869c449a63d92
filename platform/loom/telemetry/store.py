"""Writing ingested batches: any number of ranks' batches in one transaction.

Each batch is claimed once by its (attempt, rank, seq) key, its events take the run's next seq numbers
(one UPDATE … RETURNING per run and transaction, not a row lock per batch), and `metric` and `heartbeat`
events are projected into the tables the charts read (RankStep, RankTile, RankStatus). The group
commit in writer.py calls this with whatever batches arrived together; a single batch is a list of one.
"""

import hashlib
import json
import logging
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import groupby

from django.db import connection, transaction
from django.dispatch import Signal
from django.utils import timezone

from . import bulk
from .models import Event, IngestConflict, wire_fields
from .publish import publish

log = logging.getLogger(__name__)

LAUNCHER_RANK = -1
# What the integer columns hold (PostgreSQL's int and bigint): a value beyond them is no row.
INT_MAX = 2**31 - 1
BIGINT_MAX = 2**63 - 1
# A tile sums this many consecutive steps of one rank; a chart picks the coarsest that still gives
# it enough columns (queries.py). Powers of 8 keep every level within 8× of the width asked for.
TILE_SPANS = (8, 64, 512, 4096)

BATCHES = bulk.Table(
    "telemetry_ingestbatch",
    (
        ("attempt_id", "bigint"),
        ("rank", "int"),
        ("seq", "bigint"),
        ("event_count", "int"),
        ("received_at", "timestamptz"),
        ("digest", "text"),
    ),
)
EVENTS = bulk.Table(
    "telemetry_event",
    (
        ("run_id", "bigint"),
        ("seq", "bigint"),
        ("attempt_id", "bigint"),
        ("kind", "text"),
        ("rank", "int"),
        ("step", "bigint"),
        ("payload", "jsonb"),
        ("time", "timestamptz"),
        ("received_at", "timestamptz"),
    ),
)
RANK_STEPS = bulk.Table(
    "telemetry_rankstep",
    (
        ("run_id", "bigint"),
        ("attempt_id", "bigint"),
        ("rank", "int"),
        ("step", "bigint"),
        ("time", "timestamptz"),
        ("loss", "float8"),
        ("loss_mean", "float8"),
        ("grad_norm", "float8"),
        ("lr", "float8"),
        ("step_time_s", "float8"),
        ("tokens_per_s", "float8"),
        ("mfu", "float8"),
        ("memory_bytes", "bigint"),
        ("memory_peak_bytes", "bigint"),
        ("compute_s", "float8"),
        ("eval_loss", "float8"),
    ),
)
RANK_STEP_COLUMNS = [name for name, _ in RANK_STEPS.columns]
# RankStep column → the RankTile columns' prefix ({prefix}_sum, _min, _max).
TILED_METRICS = (("step_time_s", "step_time"), ("memory_bytes", "memory"), ("compute_s", "compute"))
RANK_TILES = bulk.Table(
    "telemetry_ranktile",
    (
        ("attempt_id", "bigint"),
        ("span", "int"),
        ("bucket", "bigint"),
        ("rank", "int"),
        ("count", "int"),
        ("step_time_sum", "float8"),
        ("step_time_min", "float8"),
        ("step_time_max", "float8"),
        ("memory_sum", "float8"),
        ("memory_min", "bigint"),
        ("memory_max", "bigint"),
        ("compute_sum", "float8"),
        ("compute_min", "float8"),
        ("compute_max", "float8"),
    ),
)
RANK_STATUS = bulk.Table(
    "telemetry_rankstatus",
    (
        ("attempt_id", "bigint"),
        ("rank", "int"),
        ("host", "text"),
        ("pid", "int"),
        ("last_heartbeat", "timestamptz"),
        ("heard_at", "timestamptz"),
        ("last_step", "bigint"),
        ("collectives", "jsonb"),
    ),
)


@dataclass(frozen=True)
class PendingBatch:
    """A validated batch: events are {kind, time, step, payload} dicts in the order the rank sent them."""

    attempt_id: int
    attempt_number: int
    run_id: int
    rank: int
    seq: int
    events: list[dict]
    # content_digest(events): a batch sent again under its key must be the same batch. Empty: not known.
    digest: str = ""

    @property
    def key(self) -> tuple[int, int, int]:
        return self.attempt_id, self.rank, self.seq


@dataclass(frozen=True)
class IngestResult:
    stored: int
    duplicate: bool
    # Its key was stored before with other events: this batch was kept aside (IngestConflict), not stored.
    conflict: bool = False


def content_digest(events: list[dict]) -> str:
    """The events' fingerprint: equal for the same events, whatever order their payloads' keys came in."""
    encoded = json.dumps(events, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(encoded, digest_size=16).hexdigest()


# Sent inside the storing transaction with every newly stored event (`events`, StoredEvents in seq order).
# Storage stores and projects; what the events mean for a run (its lifecycle, its alerts) is up to the
# receivers, which live above it and connect in their apps' ready().
events_stored = Signal()


def store_batches(batches: list[PendingBatch]) -> list[IngestResult]:
    """Store every batch not stored before, all or nothing; answers in the order given. A batch whose key
    was stored with other events is kept aside as a conflict, so nothing a rank sent is silently dropped."""
    with transaction.atomic():
        with bulk.pipelined():
            fresh = _claim(batches)
            new = [batch for batch, is_new in zip(batches, fresh, strict=True) if is_new]
            events = _append(new)
            _project(events)
        conflicts = _conflicting([batch for batch, is_new in zip(batches, fresh, strict=True) if not is_new])
        if events:
            events_stored.send(sender=StoredEvent, events=events)
    return [
        IngestResult(stored=len(batch.events), duplicate=False)
        if is_new
        else IngestResult(stored=0, duplicate=id(batch) not in conflicts, conflict=id(batch) in conflicts)
        for batch, is_new in zip(batches, fresh, strict=True)
    ]


def _claim(batches: list[PendingBatch]) -> list[bool]:
    """Insert each batch's key unless it is there already; True for the batches this call claimed.
    A key twice in one call (a retry racing its original) is claimed by the first."""
    first_of_key: dict[tuple[int, int, int], int] = {}
    for index, batch in enumerate(batches):
        first_of_key.setdefault(batch.key, index)
    now = _db_time(timezone.now())
    rows = [
        (*batches[index].key, len(batches[index].events), now, batches[index].digest) for index in first_of_key.values()
    ]
    conflict = "ON CONFLICT (attempt_id, rank, seq) DO NOTHING"
    claimed = set(bulk.insert(BATCHES, rows, conflict, returning="attempt_id, rank, seq"))
    return [first_of_key[batch.key] == index and batch.key in claimed for index, batch in enumerate(batches)]


def _conflicting(repeated: list[PendingBatch]) -> set[int]:
    """Of batches whose key was already stored, those (by id()) that differ from what was stored under it;
    each is kept in IngestConflict with its events. A retry, the same batch again, is no conflict."""
    known = [batch for batch in repeated if batch.digest]
    if not known:
        return set()
    keys = sorted({batch.key for batch in known})
    rows = ", ".join(["(%s, %s, %s)"] * len(keys))
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT attempt_id, rank, seq, digest FROM {BATCHES.name} "
            f"WHERE (attempt_id, rank, seq) IN (VALUES {rows})",
            [part for key in keys for part in key],
        )
        stored_digest = {(attempt_id, rank, seq): digest for attempt_id, rank, seq, digest in cursor.fetchall()}
    conflicting = [batch for batch in known if stored_digest.get(batch.key) not in ("", batch.digest)]
    IngestConflict.objects.bulk_create(
        [
            IngestConflict(
                attempt_id=batch.attempt_id, rank=batch.rank, seq=batch.seq, digest=batch.digest, events=batch.events
            )
            for batch in conflicting
        ],
        ignore_conflicts=True,
    )
    if conflicting:
        log.warning("kept aside %d batches sent again with other events: %s", len(conflicting), conflicting[0].key)
    return {id(batch) for batch in conflicting}


def _db_time(moment: datetime):
    return connection.ops.adapt_datetimefield_value(moment)


@dataclass
class StoredEvent:
    batch: PendingBatch
    seq: int
    kind: str
    step: int | None
    payload: dict
    time: datetime

    @property
    def rank(self) -> int:
        return self.batch.rank

    def as_model(self) -> Event:
        """The stored row as a model instance, for the services that take one (checkpoints)."""
        batch = self.batch
        return Event(
            run_id=batch.run_id,
            seq=self.seq,
            attempt_id=batch.attempt_id,
            kind=self.kind,
            rank=batch.rank,
            step=self.step,
            payload=self.payload,
            time=self.time,
        )

    def wire(self) -> dict:
        """As the events API and the websocket give it."""
        batch = self.batch
        return wire_fields(self.seq, self.kind, batch.attempt_number, batch.rank, self.step, self.time, self.payload)


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
                moment = datetime.fromtimestamp(item["time"], UTC)
                stored.append(
                    StoredEvent(batch, seq, item["kind"], item.get("step"), item.get("payload") or {}, moment)
                )
    now = _db_time(timezone.now())
    rows = [
        (
            event.batch.run_id,
            event.seq,
            event.batch.attempt_id,
            event.kind,
            event.batch.rank,
            event.step,
            json.dumps(event.payload),
            _db_time(event.time),
            now,
        )
        for event in stored
    ]
    bulk.append(EVENTS, rows)
    wire_by_run: dict[int, list[dict]] = defaultdict(list)
    for event in stored:
        wire_by_run[event.batch.run_id].append(event.wire())
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


def _whole(value, highest: int = BIGINT_MAX) -> int | None:
    """A payload number as a whole number for an integer column; None beyond what the column holds."""
    number = _number(value)
    return int(number) if number is not None and -highest <= number <= highest else None


def rank_step_row(run_id: int, attempt_id: int, rank: int, step: int, time, payload: dict) -> tuple:
    """A `metric` event's RankStep row (RANK_STEPS' columns)."""
    memory = payload.get("memory_allocated", payload.get("memory_rss"))
    memory_peak = payload.get("memory_peak", payload.get("memory_peak_rss"))
    return (
        run_id,
        attempt_id,
        rank,
        step,
        time,
        _number(payload.get("loss")),
        _number(payload.get("loss_mean")),
        _number(payload.get("grad_norm")),
        _number(payload.get("lr")),
        _number(payload.get("step_time_s")),
        _number(payload.get("tokens_per_s")),
        _number(payload.get("mfu")),
        _whole(memory),
        _whole(memory_peak),
        _number(payload.get("compute_s")),
        _number(payload.get("eval_loss")),
    )


def _project(events: list[StoredEvent]) -> None:
    steps = [
        rank_step_row(e.batch.run_id, e.batch.attempt_id, e.rank, e.step, _db_time(e.time), e.payload)
        for e in events
        if e.kind == "metric" and e.step is not None and e.rank >= 0
    ]
    if steps:
        with bulk.staged(RANK_STEPS, steps) as stage:
            # A step reported twice (steps re-run in the same attempt) keeps its first report.
            bulk.insert_from(RANK_STEPS, stage, "ON CONFLICT (attempt_id, rank, step) DO NOTHING")
            _add_to_tiles(stage)
    _record_heartbeats([e for e in events if e.kind == "heartbeat"])


def _add_to_tiles(stage: str) -> None:
    """Fold the staged RankStep rows into every tile level: summed per tile by the database (one
    statement may not update a row twice), then added to what each tile holds."""
    table = RANK_TILES.name
    least, greatest = ("LEAST", "GREATEST") if connection.vendor == "postgresql" else ("MIN", "MAX")

    def combined(column: str, how: str) -> str:
        # Both backends: NULL + x is NULL, and SQLite's two-argument MIN/MAX are NULL when either is.
        current, new = f"{table}.{column}", f"excluded.{column}"
        joined = f"{current} + {new}" if how == "sum" else f"{how}({current}, {new})"
        return f"{column} = COALESCE({joined}, {current}, {new})"

    updates = ", ".join(
        [f"count = {table}.count + excluded.count"]
        + [
            combined(f"{prefix}_{stat}", how)
            for _, prefix in TILED_METRICS
            for stat, how in (("sum", "sum"), ("min", least), ("max", greatest))
        ]
    )
    # Aggregates skip NULLs and are NULL over none, as a tile's stats must.
    sums = ", ".join(f"SUM({column}), MIN({column}), MAX({column})" for column, _ in TILED_METRICS)
    spans = " UNION ALL ".join(f"SELECT {span} AS span" for span in TILE_SPANS)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} ({RANK_TILES.column_list}) "
            f"SELECT attempt_id, span, step / span, rank, COUNT(*), {sums} FROM {stage} CROSS JOIN ({spans}) AS spans "
            "WHERE true GROUP BY attempt_id, span, step / span, rank "
            f"ON CONFLICT (attempt_id, span, bucket, rank) DO UPDATE SET {updates}"
        )


def _record_heartbeats(heartbeats: list[StoredEvent]) -> None:
    latest: dict[tuple[int, int], StoredEvent] = {}
    for event in heartbeats:
        key = (event.batch.attempt_id, event.rank)
        if key not in latest or latest[key].time <= event.time:
            latest[key] = event
    # Hangs are judged by the platform's clock: a rank's own clock may be off by any amount.
    heard_at = _db_time(timezone.now())
    rows = [
        (
            event.batch.attempt_id,
            event.rank,
            str(event.payload.get("host") or "")[:255],
            _whole(event.payload.get("pid"), INT_MAX),
            _db_time(event.time),
            heard_at,
            event.step,
            _json_or_null(event.payload.get("collectives")),
        )
        for _, event in sorted(latest.items())
    ]
    table = RANK_STATUS.name
    bulk.insert(
        RANK_STATUS,
        rows,
        "ON CONFLICT (attempt_id, rank) DO UPDATE SET host = excluded.host, pid = excluded.pid, "
        "last_heartbeat = excluded.last_heartbeat, heard_at = excluded.heard_at, "
        f"last_step = COALESCE(excluded.last_step, {table}.last_step), collectives = excluded.collectives",
    )


def _json_or_null(value) -> str | None:
    return None if value is None else json.dumps(value)
