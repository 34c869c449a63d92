"""Storing events: one path in (ingest and the platform's own state changes), one path out (fan-out)."""

import time
from dataclasses import dataclass
from datetime import UTC, datetime

from django.conf import settings
from django.db import transaction

from loom.accounts.tokens import hash_token
from loom.runs.models import Attempt, Run
from trainer.config import world_size_of

from .models import Event, wire
from .publish import publish, run_group
from .store import LAUNCHER_RANK, IngestResult, PendingBatch, content_digest, reserve_seqs, store_batches

__all__ = ["LAUNCHER_RANK", "IngestResult", "run_group"]


# What a refusal without named fields is about, by its status: the token, the attempt it names, the body.
REFUSED_FIELD = {401: "token", 403: "attempt", 413: "body", 415: "content_type"}


class IngestRejected(Exception):
    """A request ingest refuses: answered `status` with {"errors": errors}, the fields it names, or else
    the message under what the status is about (REFUSED_FIELD)."""

    def __init__(self, status: int, message: str, errors: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.errors = errors

    def answer(self) -> dict:
        return {"errors": self.errors or {REFUSED_FIELD.get(self.status, "body"): self.message}}


@dataclass(frozen=True)
class AttemptRef:
    """What ingest needs to know of the attempt a token was minted for."""

    attempt_id: int
    number: int
    run_id: int
    world_size: int
    # Unix seconds; None while the attempt has not ended.
    finished_at: float | None
    # time.monotonic() when this was read from the database.
    read_at: float


# A token names its attempt for good (minted once, never reassigned), so 1,024 ranks sharing one cost
# one lookup per process. Unknown tokens are not remembered. Whether the attempt has finished is read
# again once the entry is TOKEN_RECHECK_S old (never later than the grace, so a token is refused on time).
_attempts_by_token_hash: dict[str, AttemptRef] = {}
KNOWN_TOKENS_KEPT = 4096
TOKEN_RECHECK_S = 5.0


def known_attempt(token: str) -> AttemptRef | None:
    """The attempt of a token this process has seen lately, without asking the database."""
    known = _attempts_by_token_hash.get(hash_token(token)) if token else None
    if known is None or known.finished_at is not None:
        return known
    recheck_s = min(TOKEN_RECHECK_S, settings.LOOM_INGEST_GRACE_S)
    return known if time.monotonic() - known.read_at < recheck_s else None


def attempt_for_token(token: str) -> AttemptRef:
    known = known_attempt(token)
    if known is not None:
        return known
    token_hash = hash_token(token) if token else ""
    fields = ("pk", "number", "run_id", "config", "finished_at")
    found = Attempt.objects.filter(token_hash=token_hash).values_list(*fields).first()
    if not token or found is None:
        raise IngestRejected(401, "unknown attempt token")
    attempt_id, number, run_id, config, finished_at = found
    if len(_attempts_by_token_hash) >= KNOWN_TOKENS_KEPT:
        _attempts_by_token_hash.clear()
    _attempts_by_token_hash[token_hash] = AttemptRef(
        attempt_id,
        number,
        run_id,
        world_size_of(config),
        finished_at.timestamp() if finished_at is not None else None,
        time.monotonic(),
    )
    return _attempts_by_token_hash[token_hash]


def refuse_expired_token(attempt: AttemptRef) -> None:
    """A finished attempt's token stores for LOOM_INGEST_GRACE_S more (its ranks' and its launcher's last
    batches), then never again: a leaked token of a finished run cannot write into it."""
    grace_s = settings.LOOM_INGEST_GRACE_S
    if attempt.finished_at is not None and time.time() > attempt.finished_at + grace_s:
        ended = datetime.fromtimestamp(attempt.finished_at, UTC).isoformat(timespec="seconds")
        raise IngestRejected(
            401, f"attempt {attempt.attempt_id} finished at {ended}; its token expired {grace_s:g} s after that"
        )


def pending_batch(attempt: AttemptRef, rank: int, seq: int, events: list[dict]) -> PendingBatch:
    return PendingBatch(attempt.attempt_id, attempt.number, attempt.run_id, rank, seq, events, content_digest(events))


def ingest_batch(attempt: Attempt, rank: int, seq: int, events: list[dict]) -> IngestResult:
    """Store a rank's numbered batch exactly once, in the caller's thread and transaction."""
    batch = PendingBatch(attempt.pk, attempt.number, attempt.run_id, rank, seq, events, content_digest(events))
    (result,) = store_batches([batch])
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
