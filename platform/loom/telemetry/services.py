"""Storing events: one path in (ingest and the platform's own state changes), one path out (fan-out)."""

import logging
from dataclasses import dataclass
from datetime import UTC, datetime

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import IntegrityError, transaction

from loom.accounts.tokens import hash_token
from loom.checkpoints.services import record_checkpoint_event
from loom.runs import services as run_services
from loom.runs.models import Attempt, Run

from .fanout import Coalescer
from .models import Event, IngestBatch

log = logging.getLogger(__name__)

LAUNCHER_RANK = -1


def run_group(run_id: int) -> str:
    return f"run.{run_id}"


@dataclass(frozen=True)
class IngestResult:
    stored: int
    duplicate: bool


class IngestRejected(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def attempt_for_token(token: str) -> Attempt:
    attempt = Attempt.objects.select_related("run").filter(token_hash=hash_token(token)).first() if token else None
    if attempt is None:
        raise IngestRejected(401, "unknown attempt token")
    return attempt


def ingest_batch(attempt: Attempt, rank: int, seq: int, events: list[dict]) -> IngestResult:
    """Store a rank's numbered batch exactly once and fan its events out after commit."""
    with transaction.atomic():
        run = Run.objects.select_for_update().get(pk=attempt.run_id)
        try:
            with transaction.atomic():
                IngestBatch.objects.create(attempt=attempt, rank=rank, seq=seq, event_count=len(events))
        except IntegrityError:
            return IngestResult(stored=0, duplicate=True)
        stored = _append(run, attempt, rank, events)
        for event in stored:
            if event.kind == "checkpoint":
                record_checkpoint_event(attempt, event)
            elif event.kind == "state" and rank == LAUNCHER_RANK:
                _apply_launcher_state(attempt, event.payload)
    return IngestResult(stored=len(stored), duplicate=False)


def record_platform_event(run: Run, attempt: Attempt | None, kind: str, payload: dict) -> Event:
    """An event the platform itself caused (run created, cancel requested). Call inside a transaction."""
    locked = Run.objects.select_for_update().get(pk=run.pk)
    now = datetime.now(UTC).timestamp()
    (event,) = _append(locked, attempt, None, [{"kind": kind, "time": now, "step": None, "payload": payload}])
    return event


def _append(run: Run, attempt: Attempt | None, rank: int | None, events: list[dict]) -> list[Event]:
    """Give events the run's next seq numbers and store them; the caller holds the run's row lock."""
    first = run.last_seq + 1
    rows = [
        Event(
            run=run,
            seq=first + offset,
            attempt=attempt,
            kind=item["kind"],
            rank=rank,
            step=item.get("step"),
            payload=item.get("payload") or {},
            time=datetime.fromtimestamp(item["time"], UTC),
        )
        for offset, item in enumerate(events)
    ]
    Event.objects.bulk_create(rows)
    run.last_seq = first + len(rows) - 1
    Run.objects.filter(pk=run.pk).update(last_seq=run.last_seq)
    wire = [row.as_wire() for row in rows]
    transaction.on_commit(lambda: publish(run.pk, wire))
    return rows


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


def send_to_group(run_id: int, events: list[dict]) -> None:
    async_to_sync(get_channel_layer().group_send)(run_group(run_id), {"type": "run.events", "events": events})


# One per process: the platform's settings decide how often a run's pages may hear from it.
_coalescer = Coalescer(send_to_group, settings.LOOM_FANOUT_INTERVAL_S)


def publish(run_id: int, events: list[dict]) -> None:
    """Fan events out to the run's websocket group, coalesced with others stored within the interval.
    Loss here is repaired by the page's resync."""
    _coalescer.add(run_id, events)


def events_after(run: Run, after: int, limit: int) -> list[Event]:
    return list(Event.objects.filter(run=run, seq__gt=after).select_related("attempt").order_by("seq")[:limit])
