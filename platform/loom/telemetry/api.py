from django.core.exceptions import RequestDataTooBig
from django.http import JsonResponse
from ninja import Router, Status
from pydantic import ValidationError

from loom.operations.metrics import count_ingest_answer
from loom.operations.structured_logs import run_context
from loom.runs import services as run_services
from loom.runs.api import FieldErrors
from trainer.config import field_errors

from . import charts, experts
from .charts import ChartInputError
from .ingest import BatchIn, bearer, read_batch, refuse_unless_json, result_answer, too_large
from .services import IngestRejected, attempt_for_token
from .store import store_batches

router = Router(tags=["telemetry"])


class AttemptToken:
    """The attempt's own token (`Authorization: Bearer <token>`), as the OpenAPI document names its scheme.
    It lets every request through to the view, which checks the token itself: ingest's refusals (unknown,
    expired, another attempt's) carry messages of their own, the same as the ASGI endpoint's."""

    openapi_security_schema = {
        "type": "http",
        "scheme": "bearer",
        "description": "The token minted for one attempt when it was launched (LOOM_TOKEN in its ranks' environment); "
        "refused once the attempt has been finished for LOOM_INGEST_GRACE_S.",
    }

    def __call__(self, request):
        return True


def _inlined(schema: dict) -> dict:
    """A pydantic JSON schema with its nested models written in place: an operation's schema in the OpenAPI
    document cannot point into a `$defs` of its own (`#/$defs/…` is resolved from the document's root)."""
    definitions = schema.pop("$defs", {})

    def resolve(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(definitions[node["$ref"].removeprefix("#/$defs/")])
            return {key: resolve(value) for key, value in node.items()}
        if isinstance(node, list):
            return [resolve(item) for item in node]
        return node

    return resolve(schema)


def _json_answer(description: str, schema: dict) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_FIELD_ERRORS = {
    "type": "object",
    "properties": {"errors": {"type": "object", "additionalProperties": {"type": "string"}}},
    "required": ["errors"],
}
_BATCH = _inlined(BatchIn.model_json_schema())
_STORED = {
    "type": "object",
    "properties": {"stored": {"type": "integer"}, "duplicate": {"type": "boolean"}},
    "required": ["stored", "duplicate"],
}


@router.post(
    "/ingest",
    auth=AttemptToken(),
    openapi_extra={
        "requestBody": {"content": {"application/json": {"schema": _BATCH}}, "required": True},
        "responses": {
            "200": _json_answer("Stored, or already stored (duplicate: the same batch again).", _STORED),
            "400": _json_answer("A field no stored event may hold, or a body that is not JSON; named.", _FIELD_ERRORS),
            "401": _json_answer("No token, an unknown one, or a finished attempt's past the grace.", _FIELD_ERRORS),
            "403": _json_answer("A batch for another attempt than the token's.", _FIELD_ERRORS),
            "409": _json_answer("This (attempt, rank, seq) was stored with other events; kept aside.", _FIELD_ERRORS),
            "413": _json_answer("More bytes or events than a batch may have.", _FIELD_ERRORS),
            "415": _json_answer("A body that is not application/json.", _FIELD_ERRORS),
            "503": _json_answer("Busy, or the database is unreachable: send it again later.", _FIELD_ERRORS),
        },
    },
)
def ingest(request):
    """Store a rank's numbered telemetry batch once (idempotent) with the attempt's own token.

    Under ASGI the endpoint in ingest_app.py answers this path with the same rules (ingest.py) and
    group-commits; this route documents it and serves the Django test client and WSGI.
    """
    status, answer = _ingest(request)
    count_ingest_answer(status, answer.get("stored", 0) if status == 200 else 0)
    return JsonResponse(answer, status=status)


def _ingest(request) -> tuple[int, dict]:
    try:
        attempt = attempt_for_token(bearer(request.headers.get("Authorization", "")))
    except IngestRejected as rejected:
        return rejected.status, rejected.answer()
    with run_context(attempt.run_id, attempt.attempt_id):
        try:
            refuse_unless_json(request.headers.get("Content-Type", ""))
            try:
                body = request.body
            except RequestDataTooBig:
                raise too_large() from None
            batch = read_batch(attempt, body)
        except IngestRejected as rejected:
            return rejected.status, rejected.answer()
        except ValidationError as error:
            return 400, {"errors": field_errors(error)}
        (result,) = store_batches([batch])
        return result_answer(batch, result)


# ---- what the run page's charts read (charts.py); plain dicts, sized to the chart ----

WIDTH_MAX = 4000


def _chart(compute):
    try:
        return Status(200, compute())
    except ChartInputError as error:
        return Status(400, {"errors": error.errors})


def _width(width: int) -> int:
    return max(1, min(width, WIDTH_MAX))


def _ranks(ranks: str) -> list[int] | None:
    if not ranks:
        return None
    try:
        return sorted({int(rank) for rank in ranks.split(",")})
    except ValueError:
        raise ChartInputError({"ranks": f"{ranks!r} is not a comma-separated list of ranks"}) from None


@router.get("/runs/{run_id}/metrics/series", response={200: dict, 400: FieldErrors})
def metric_series(request, run_id: int, width: int = 800, start: int | None = None, end: int | None = None):
    """Per attempt: loss (mean over ranks), validation loss (eval_loss, on the steps evaluated only), grad
    norm, lr, tokens/s (all ranks) and MFU over steps, downsampled to the width (each bucket's first, lowest,
    highest and last point)."""
    run = run_services.run_for(request.user, run_id)
    return _chart(lambda: charts.series(run, _width(width), start, end))


@router.get("/runs/{run_id}/metrics/ranks", response={200: dict, 400: FieldErrors})
def rank_metric(
    request,
    run_id: int,
    metric: str = "step_time_s",
    width: int = 800,
    attempt: int | None = None,
    start: int | None = None,
    end: int | None = None,
    ranks: str = "",
):
    """Step time, own work or memory per rank: lines for up to 8 ranks (or those asked for), else a
    min/median/max band."""
    run = run_services.run_for(request.user, run_id)
    return _chart(lambda: charts.rank_metric(run, metric, _width(width), attempt, start, end, _ranks(ranks)))


@router.get("/runs/{run_id}/metrics/heatmap", response={200: dict, 400: FieldErrors})
def rank_step_heatmap(
    request,
    run_id: int,
    metric: str = "step_time_s",
    width: int = 800,
    attempt: int | None = None,
    start: int | None = None,
    end: int | None = None,
    span: int | None = None,
):
    """Rank × step: each rank's mean step time, own work or memory per bucket of steps (of `span` steps
    when given: 1 or a tile span), with each rank's host."""
    run = run_services.run_for(request.user, run_id)
    return _chart(lambda: charts.heatmap(run, metric, _width(width), attempt, start, end, span))


def _layers(layers: str) -> list[str] | None:
    if not layers:
        return None
    try:
        return [str(layer) for layer in sorted({int(layer) for layer in layers.split(",")})]
    except ValueError:
        raise ChartInputError({"layers": f"{layers!r} is not a comma-separated list of layers"}) from None


@router.get("/runs/{run_id}/metrics/experts", response={200: dict, 400: FieldErrors})
def expert_load(
    request,
    run_id: int,
    width: int = 800,
    attempt: int | None = None,
    start: int | None = None,
    end: int | None = None,
    layers: str = "",
):
    """A mixture-of-experts run's routing per layer (those asked for, else every one) and column of steps:
    tokens per expert, load imbalance (max / mean over experts; a column's highest), token copies dropped and
    balance loss. A dense run has no layers."""
    run = run_services.run_for(request.user, run_id)
    return _chart(lambda: experts.expert_load(run, _width(width), attempt, start, end, _layers(layers)))


@router.get("/runs/{run_id}/comm", response={200: dict, 400: FieldErrors})
def comm_matrix(request, run_id: int, attempt: int | None = None, start: int | None = None, end: int | None = None):
    """Measured rank × rank bytes per step over the windows in [start, end] (default: the latest window),
    and the planner's predicted matrix for the attempt's layout; blocks of ranks above 256 ranks."""
    run = run_services.run_for(request.user, run_id)
    return _chart(lambda: charts.comm(run, attempt, start, end))
