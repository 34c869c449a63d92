import json
from typing import Literal

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import JsonResponse
from ninja import Router
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainer.config import field_errors

from .services import IngestRejected, attempt_for_token, ingest_batch

router = Router(tags=["telemetry"])


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


def _bearer(request) -> str:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


@router.post(
    "/ingest",
    auth=None,
    openapi_extra={
        "requestBody": {"content": {"application/json": {"schema": BatchIn.model_json_schema()}}, "required": True},
        "security": [{"AttemptToken": []}],
    },
)
def ingest(request):
    """Store a rank's numbered telemetry batch once (idempotent) with the attempt's own token.

    200 {stored, duplicate}; 400 malformed; 401 unknown token; 403 another attempt's batch; 413 too large.
    """
    try:
        attempt = attempt_for_token(_bearer(request))
        batch = _parse(request)
        if batch.attempt != attempt.pk:
            raise IngestRejected(403, "this token may only write to its own attempt")
    except IngestRejected as rejected:
        return JsonResponse({"detail": rejected.message}, status=rejected.status)
    except ValidationError as error:
        return JsonResponse({"errors": field_errors(error)}, status=400)
    result = ingest_batch(attempt, batch.rank, batch.seq, [event.model_dump() for event in batch.events])
    return {"stored": result.stored, "duplicate": result.duplicate}


def _parse(request) -> BatchIn:
    limit = settings.LOOM_INGEST_MAX_BYTES
    too_large = IngestRejected(413, f"batch larger than {limit} bytes or {settings.LOOM_INGEST_MAX_EVENTS} events")
    if int(request.headers.get("Content-Length") or 0) > limit:
        raise too_large
    try:
        body = request.body
    except RequestDataTooBig:
        raise too_large from None
    if len(body) > limit:
        raise too_large
    try:
        # Bare NaN/Infinity (not JSON, but what json.dumps writes by default) are kept as the strings the
        # trainer's client sends for them: a diverging loss is a measurement, and JSONB refuses bare NaN.
        document = json.loads(body, parse_constant=str)
    except (ValueError, UnicodeDecodeError):
        raise IngestRejected(400, "body is not JSON") from None
    if isinstance(document, dict) and len(document.get("events") or []) > settings.LOOM_INGEST_MAX_EVENTS:
        raise too_large
    return BatchIn.model_validate(document)
