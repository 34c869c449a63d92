"""POST /api/ingest as a plain ASGI application, mounted ahead of Django in loom.asgi.

Every rank of every run posts here about once a second. Django's request path (middleware, a thread
per sync view, a connection per request) cost ~10 ms of CPU per batch; this endpoint does only what
ingest needs (token, size, JSON, schema) on the event loop, looks a token up once per process, and
hands the batch to the group-commit writer, answering when it is committed. The rules of what it takes are
ingest.py's.
"""

import json
import logging

import psycopg
from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from django.conf import settings
from django.db import DataError
from pydantic import ValidationError

from loom.operations.metrics import count_ingest_answer
from loom.operations.structured_logs import run_context
from trainer.config import field_errors

from .ingest import bearer, read_batch, refuse_unless_json, result_answer, too_large
from .services import AttemptRef, IngestRejected, attempt_for_token, known_attempt
from .writer import WriterBusy, writer

log = logging.getLogger(__name__)

Headers = list[tuple[bytes, bytes]]

# Token lookups on a cache miss and the JSON/schema work of large batches run off the event loop;
# small batches are read on it, which is cheaper than a thread hop.
_attempt_for_token = database_sync_to_async(attempt_for_token)
_read_batch = sync_to_async(read_batch, thread_sensitive=False)
SMALL_BODY_BYTES = 64 * 1024
DISCARD_LIMIT_BYTES = 64 * 1024 * 1024


async def ingest_endpoint(scope, receive, send) -> None:
    """Every answer is JSON, an unexpected error included (logged with its traceback, answered 500), and
    counted for /metrics."""
    try:
        status, document, headers = await _ingest(scope, receive)
    except Exception:
        log.exception("ingest failed unexpectedly")
        status, document, headers = (
            500,
            {"errors": {"server": "ingest failed unexpectedly; the error is in the platform's log"}},
            [],
        )
    count_ingest_answer(status, document.get("stored", 0) if status == 200 else 0)
    await _answer(send, status, document, headers)


async def _ingest(scope, receive) -> tuple[int, dict, Headers]:
    if scope["method"] != "POST":
        return 405, {"errors": {"method": "POST a telemetry batch"}}, [(b"allow", b"POST")]
    headers = dict(scope["headers"])
    try:
        body = await _body(receive, settings.LOOM_INGEST_MAX_BYTES)
        token = bearer(headers.get(b"authorization", b"").decode("latin-1"))
        attempt = known_attempt(token) or await _attempt_for_token(token)
    except IngestRejected as rejected:
        return rejected.status, rejected.answer(), []
    with run_context(attempt.run_id, attempt.attempt_id):
        return await _store(attempt, headers, body)


async def _store(attempt: AttemptRef, headers: dict[bytes, bytes], body: bytes) -> tuple[int, dict, Headers]:
    try:
        refuse_unless_json(headers.get(b"content-type", b"").decode("latin-1"))
        batch = read_batch(attempt, body) if len(body) <= SMALL_BODY_BYTES else await _read_batch(attempt, body)
    except IngestRejected as rejected:
        return rejected.status, rejected.answer(), []
    except ValidationError as error:
        return 400, {"errors": field_errors(error)}, []
    try:
        result = await writer.submit_from_loop(batch)
    except WriterBusy as busy:
        return 503, {"errors": {"server": f"{busy}; retry"}}, [(b"retry-after", b"1")]
    except (DataError, psycopg.DataError) as error:
        # Validation should have refused it; the database's word is final for this batch, so the sender
        # must not retry it.
        log.exception("the database refused batch %s of rank %s (attempt %s)", batch.seq, batch.rank, batch.attempt_id)
        return 400, {"errors": {"events": f"the database refused them: {error}"}}, []
    except Exception:
        log.exception("storing batch %s of rank %s (attempt %s) failed", batch.seq, batch.rank, batch.attempt_id)
        return 503, {"errors": {"server": "the batch could not be stored; retry"}}, [(b"retry-after", b"1")]
    status, answer = result_answer(batch, result)
    return status, answer, []


async def _body(receive, limit: int) -> bytes:
    """The whole body, or IngestRejected(413) once it passes the limit. An oversized body is still read to
    its end (up to DISCARD_LIMIT_BYTES) before the answer: a server that answers and closes while the
    client is still sending leaves that client with a broken pipe, which it would retry, instead of the
    413 that tells it not to."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise IngestRejected(400, "the client went away before sending the whole batch")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        if not message.get("more_body") or size > DISCARD_LIMIT_BYTES:
            break
    if size > limit:
        raise too_large()
    return b"".join(chunks)


async def _answer(send, status: int, document: dict, headers: Headers) -> None:
    body = json.dumps(document).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})
