"""What an ingest request must be: the attempt's live token, a JSON batch within the limits, for that
attempt and one of its ranks, holding only what storage can hold. Shared by the ASGI endpoint that serves
it and the API route that documents it.

Validation is total: a batch that passes is one the database takes (integers within their columns, finite
numbers, no NUL character, which PostgreSQL's text and JSONB refuse), so a batch is either stored or refused
with 400 naming the field, never answered "retry" for a batch that could never be stored: the client sends
a rank's batches oldest first, and one such batch would hold back every later one.

Who may report what: the launcher (rank -1) reports the attempt's lifecycle (`state` events whose state is
an attempt state: running, succeeded, failed, …); a rank's own `state` events say only what happened to that
rank (RANK_STATES: started, stopped, finished) and move nothing.
"""

import json
import re
from typing import Literal

from django.conf import settings
from pydantic import BaseModel, ConfigDict, Field

from loom.runs import states

from .services import AttemptRef, IngestRejected, pending_batch, refuse_expired_token
from .store import BIGINT_MAX, INT_MAX, LAUNCHER_RANK, IngestResult, PendingBatch

# Unix seconds from the epoch to 2200-01-01: wider than any clock a rank has, narrower than what a
# timestamp column or Python's datetime can hold.
TIME_MAX = 7_258_118_400
# Payload limits. A dict or list nested deeper than this is no metric; strings stay well above the
# trainer's 64 Ki-character log messages.
MAX_PAYLOAD_DEPTH = 32
MAX_STRING_CHARS = 128 * 1024
# Payload integers: what a 64-bit integer holds (the projected columns are bigint, and beyond 2**53 a
# browser's number is inexact anyway).
PAYLOAD_INT_MIN, PAYLOAD_INT_MAX = -(2**63), 2**63 - 1
RANK_STATES = frozenset({"started", "stopped", "finished"})
# A NUL or a lone surrogate (no character UTF-8 can encode) reaches a parsed string only through a \\u escape:
# JSON refuses raw control characters and UTF-8 holds no surrogates.
_UNSTORABLE_CHARACTER = re.compile("[\x00\ud800-\udfff]")


class EventIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["metric", "heartbeat", "comm", "log", "checkpoint", "state"]
    time: float = Field(
        ge=0, le=TIME_MAX, allow_inf_nan=False, description="Unix seconds when the event was emitted at its source."
    )
    step: int | None = Field(default=None, ge=0, le=BIGINT_MAX, description="The training step it belongs to.")
    payload: dict = Field(
        default_factory=dict,
        description=f"JSON object: finite numbers, integers within 64 bits, strings without NUL of at most "
        f"{MAX_STRING_CHARS} characters, nested at most {MAX_PAYLOAD_DEPTH} levels.",
    )


class BatchIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    attempt: int = Field(description="The attempt id the token was issued for.")
    rank: int = Field(
        ge=LAUNCHER_RANK, le=INT_MAX, description="The sending rank, below its attempt's world size; -1: the launcher."
    )
    seq: int = Field(
        ge=0, le=BIGINT_MAX, description="The sender's batch number; a batch is stored once per (attempt, rank, seq)."
    )
    events: list[EventIn]


def bearer(authorization: str) -> str:
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def too_large() -> IngestRejected:
    limit = settings.LOOM_INGEST_MAX_BYTES
    return IngestRejected(413, f"batch larger than {limit} bytes or {settings.LOOM_INGEST_MAX_EVENTS} events")


def refuse_unless_json(content_type: str) -> None:
    if content_type.partition(";")[0].strip().lower() != "application/json":
        raise IngestRejected(415, f"send the batch as application/json, not {content_type or 'no content type'}")


def read_batch(attempt: AttemptRef, body: bytes) -> PendingBatch:
    """The batch to store for the token's attempt; IngestRejected (401 expired token, 403, 413, 400 not
    JSON or a field no row can hold) or pydantic's ValidationError."""
    refuse_expired_token(attempt)
    if len(body) > settings.LOOM_INGEST_MAX_BYTES:
        raise too_large()
    try:
        # Bare NaN/Infinity (not JSON, but what json.dumps writes by default) are kept as the strings the
        # trainer's client sends for them: a diverging loss is a measurement, and JSONB refuses bare NaN.
        document = json.loads(body, parse_constant=str)
    except RecursionError:
        message = f"must be nested at most {MAX_PAYLOAD_DEPTH} levels deep"
        raise IngestRejected(400, "nested too deeply", {_too_deep_field(body): message}) from None
    except (ValueError, UnicodeDecodeError) as error:
        raise IngestRejected(400, "body is not JSON", {"body": f"is not JSON: {error}"}) from None
    if not isinstance(document, dict):
        raise IngestRejected(400, "not a batch", {"body": "must be a JSON object: {attempt, rank, seq, events}"})
    events = document.get("events")
    if isinstance(events, list) and len(events) > settings.LOOM_INGEST_MAX_EVENTS:
        raise too_large()
    batch = BatchIn.model_validate(document)
    if batch.attempt != attempt.attempt_id:
        raise IngestRejected(403, "this token may only write to its own attempt")
    if batch.rank >= attempt.world_size:
        message = f"must be below the attempt's world size {attempt.world_size}, or {LAUNCHER_RANK} for the launcher"
        raise IngestRejected(400, "no such rank", {"rank": message})
    events = [event.model_dump() for event in batch.events]
    # Strings are looked at only when one could be unstorable: escaped characters in the body, or a body
    # longer than a string may be. Every number is looked at.
    check_strings = len(body) > MAX_STRING_CHARS or b"\\u" in body
    errors = _event_errors(batch.rank, events, check_strings)
    if errors:
        raise IngestRejected(400, "invalid events", errors)
    return pending_batch(attempt, batch.rank, batch.seq, events)


def result_answer(batch: PendingBatch, result: IngestResult) -> tuple[int, dict]:
    """The HTTP status and body that answer a stored (or repeated, or conflicting) batch."""
    if result.conflict:
        message = (
            f"batch {batch.seq} of rank {batch.rank} was stored before with other events; "
            "this one is kept aside for inspection, not stored"
        )
        return 409, {"errors": {"seq": message}}
    return 200, {"stored": result.stored, "duplicate": result.duplicate}


def _event_errors(rank: int, events: list[dict], check_strings: bool) -> dict[str, str]:
    """Field errors of what the schema cannot say: who may send which state, and what in a payload
    storage could not hold."""
    errors: dict[str, str] = {}
    for index, event in enumerate(events):
        payload = event["payload"]
        if event["kind"] == "state":
            if problem := _state_problem(rank, payload.get("state")):
                errors.setdefault(f"events.{index}.payload.state", problem)
        if problem := _container_problem(payload, f"events.{index}.payload", 1, check_strings):
            errors.setdefault(*problem)
    return errors


def _state_problem(rank: int, state) -> str | None:
    if not isinstance(state, str):
        return "must be a string"
    if rank == LAUNCHER_RANK:
        if state not in states.TRANSITIONS:
            return f"the launcher reports an attempt state: one of {', '.join(states.TRANSITIONS)}"
    elif state not in RANK_STATES:
        return f"a rank reports only its own state ({', '.join(sorted(RANK_STATES))}); the launcher reports {state!r}"
    return None


def _container_problem(container: dict | list, path: str, depth: int, check_strings: bool) -> tuple[str, str] | None:
    """The first (field, message) in a payload dict or list that storage could not hold, or None. Scalars are
    judged in the loop, not by a call each: a comm event's payload holds a row of the traffic matrix."""
    if depth > MAX_PAYLOAD_DEPTH:
        return path, f"must be nested at most {MAX_PAYLOAD_DEPTH} levels deep"
    is_dict = type(container) is dict
    for key, item in container.items() if is_dict else enumerate(container):
        if is_dict and check_strings and (len(key) > MAX_STRING_CHARS or _UNSTORABLE_CHARACTER.search(key)):
            return path, f"a key must be at most {MAX_STRING_CHARS} characters, without NUL or a lone surrogate"
        kind = type(item)
        if kind is float:
            # inf - inf and nan - nan are nan, which equals nothing.
            if item - item != 0.0:
                return f"{path}.{key}", "must be a finite number"
        elif kind is int:
            if not PAYLOAD_INT_MIN <= item <= PAYLOAD_INT_MAX:
                return f"{path}.{key}", "must be an integer within 64 bits (-2**63 to 2**63 - 1)"
        elif kind is str:
            if check_strings and (problem := _string_problem(item)):
                return f"{path}.{key}", problem
        elif kind is dict or kind is list:
            if problem := _container_problem(item, f"{path}.{key}", depth + 1, check_strings):
                return problem
    return None


def _string_problem(value: str) -> str | None:
    if len(value) > MAX_STRING_CHARS:
        return f"must be at most {MAX_STRING_CHARS} characters"
    if _UNSTORABLE_CHARACTER.search(value):
        return "must not contain the NUL character (\\u0000) or a lone surrogate"
    return None


def _too_deep_field(body: bytes) -> str:
    """The event whose payload is nested too deeply for the JSON parser itself, found by following the
    brackets of the raw body (outside strings): the batch is an object, its events the array at depth 2."""
    depth, event = 0, 0
    for match in re.finditer(rb'"(?:[^"\\]|\\.)*"|[\[\]{},]', body):
        token = match[0]
        if token in (b"[", b"{"):
            depth += 1
            if depth > MAX_PAYLOAD_DEPTH + 3:
                return f"events.{event}.payload"
        elif token in (b"]", b"}"):
            depth -= 1
        elif token == b"," and depth == 2:
            event += 1
    return "events"
