"""What an ingest request must be: the attempt's token, a JSON batch within the limits, for that
attempt. Shared by the ASGI endpoint that serves it and the API route that documents it."""

import json
from typing import Literal

from django.conf import settings
from pydantic import BaseModel, ConfigDict, Field

from .services import AttemptRef, IngestRejected, pending_batch
from .store import PendingBatch


class EventIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["metric", "heartbeat", "comm", "log", "checkpoint", "state"]
    time: float = Field(allow_inf_nan=False, description="Unix seconds when the event was emitted at its source.")
    step: int | None = None
    payload: dict = Field(default_factory=dict)


class BatchIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    attempt: int = Field(description="The attempt id the token was issued for.")
    rank: int = Field(ge=-1, description="The sending rank; -1 is the launcher.")
    seq: int = Field(ge=0, description="The sender's batch number; a batch is stored once per (attempt, rank, seq).")
    events: list[EventIn]


def bearer(authorization: str) -> str:
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def too_large() -> IngestRejected:
    limit = settings.LOOM_INGEST_MAX_BYTES
    return IngestRejected(413, f"batch larger than {limit} bytes or {settings.LOOM_INGEST_MAX_EVENTS} events")


def read_batch(attempt: AttemptRef, body: bytes) -> PendingBatch:
    """The batch to store for the token's attempt; IngestRejected (403, 413, 400 not JSON) or pydantic's
    ValidationError."""
    if len(body) > settings.LOOM_INGEST_MAX_BYTES:
        raise too_large()
    try:
        # Bare NaN/Infinity (not JSON, but what json.dumps writes by default) are kept as the strings the
        # trainer's client sends for them: a diverging loss is a measurement, and JSONB refuses bare NaN.
        document = json.loads(body, parse_constant=str)
    except (ValueError, UnicodeDecodeError):
        raise IngestRejected(400, "body is not JSON") from None
    if isinstance(document, dict) and len(document.get("events") or []) > settings.LOOM_INGEST_MAX_EVENTS:
        raise too_large()
    batch = BatchIn.model_validate(document)
    if batch.attempt != attempt.attempt_id:
        raise IngestRejected(403, "this token may only write to its own attempt")
    return pending_batch(attempt, batch.rank, batch.seq, [event.model_dump() for event in batch.events])
