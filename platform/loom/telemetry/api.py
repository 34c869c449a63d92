from django.core.exceptions import RequestDataTooBig
from django.http import JsonResponse
from ninja import Router, Status
from pydantic import ValidationError

from loom.runs import services as run_services
from loom.runs.api import FieldErrors
from trainer.config import field_errors

from . import charts
from .charts import ChartInputError
from .ingest import BatchIn, bearer, read_batch, too_large
from .services import IngestRejected, attempt_for_token
from .store import store_batches

router = Router(tags=["telemetry"])


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

    200 {stored, duplicate}; 400 malformed; 401 unknown token; 403 another attempt's batch; 413 too large;
    503 busy (retry). Under ASGI the endpoint in ingest_app.py answers this path with the same rules and
    group-commits; this route documents it and serves the Django test client and WSGI.
    """
    try:
        attempt = attempt_for_token(bearer(request.headers.get("Authorization", "")))
        try:
            body = request.body
        except RequestDataTooBig:
            raise too_large() from None
        batch = read_batch(attempt, body)
    except IngestRejected as rejected:
        return JsonResponse({"detail": rejected.message}, status=rejected.status)
    except ValidationError as error:
        return JsonResponse({"errors": field_errors(error)}, status=400)
    (result,) = store_batches([batch])
    return {"stored": result.stored, "duplicate": result.duplicate}


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
    """Per attempt: loss (mean over ranks), grad norm, lr, tokens/s (all ranks) and MFU over steps,
    downsampled to the width (each bucket's first, lowest, highest and last point)."""
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


@router.get("/runs/{run_id}/comm", response={200: dict, 400: FieldErrors})
def comm_matrix(request, run_id: int, attempt: int | None = None, start: int | None = None, end: int | None = None):
    """Measured rank × rank bytes per step over the windows in [start, end] (default: the latest window),
    and the planner's predicted matrix for the attempt's layout; blocks of ranks above 256 ranks."""
    run = run_services.run_for(request.user, run_id)
    return _chart(lambda: charts.comm(run, attempt, start, end))
