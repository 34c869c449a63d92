"""Storing events: one path in (ingest and the platform's own state changes), one path out (fan-out)."""

from dataclasses import dataclass
from datetime import UTC, datetime

from django.db import transaction

from loom.accounts.tokens import hash_token
from loom.runs.models import Attempt, Run

from .models import Event, wire
from .publish import publish, run_group
from .store import LAUNCHER_RANK, IngestResult, PendingBatch, reserve_seqs, store_batches

__all__ = ["LAUNCHER_RANK", "IngestResult", "run_group"]


class IngestRejected(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class AttemptRef:
    """What ingest needs to know of the attempt a token was minted for."""

    attempt_id: int
    number: int
    run_id: int


# A token names its attempt for good (minted once, never reassigned), so 1,024 ranks sharing one cost
# one lookup per process. Unknown tokens are not remembered.
_attempts_by_token_hash: dict[str, AttemptRef] = {}
KNOWN_TOKENS_KEPT = 4096


def known_attempt(token: str) -> AttemptRef | None:
    """The attempt of a token this process has seen before, without asking the database."""
    return _attempts_by_token_hash.get(hash_token(token)) if token else None


def attempt_for_token(token: str) -> AttemptRef:
    known = known_attempt(token)
    if known is not None:
        return known
    token_hash = hash_token(token) if token else ""
    found = Attempt.objects.filter(token_hash=token_hash).values_list("pk", "number", "run_id").first()
    if not token or found is None:
        raise IngestRejected(401, "unknown attempt token")
    if len(_attempts_by_token_hash) >= KNOWN_TOKENS_KEPT:
        _attempts_by_token_hash.clear()
    _attempts_by_token_hash[token_hash] = AttemptRef(*found)
    return _attempts_by_token_hash[token_hash]


def pending_batch(attempt: AttemptRef, rank: int, seq: int, events: list[dict]) -> PendingBatch:
    return PendingBatch(attempt.attempt_id, attempt.number, attempt.run_id, rank, seq, events)


def ingest_batch(attempt: Attempt, rank: int, seq: int, events: list[dict]) -> IngestResult:
    """Store a rank's numbered batch exactly once, in the caller's thread and transaction."""
    ref = AttemptRef(attempt.pk, attempt.number, attempt.run_id)
    (result,) = store_batches([pending_batch(ref, rank, seq, events)])
    return result


def record_platform_event(run: Run, attempt: Attempt | None, kind: str, payload: dict) -> Event:
    """An event the platform itself caused (run created, cancel requested). Call inside a transaction."""
    event = Event.objects.create(
        run=run,
        seq=reserve_seqs(run.pk, 1),
        attempt=attempt,
        kind=kind,
        rank=None,
        step=None,
        payload=payload,
        time=datetime.now(UTC),
    )
    message = [wire(event, attempt.number if attempt else None)]
    transaction.on_commit(lambda: publish(run.pk, message))
    return event


def events_after(run: Run, after: int, limit: int, until: int | None = None, kinds: list[str] = ()) -> list[Event]:
    events = Event.objects.filter(run=run, seq__gt=after)
    if until is not None:
        events = events.filter(seq__lte=until)
    if kinds:
        events = events.filter(kind__in=kinds)
    return list(events.select_related("attempt").order_by("seq")[:limit])
