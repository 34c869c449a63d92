"""The planner API: estimate, search, predicted traffic and export for a layout. Nothing here
stores anything; a bad request is a 400 with one message per field to change."""

from typing import Any

from ninja import Router, Schema, Status

from loom.api.errors import Body, FieldErrors
from trainer.config import ConfigError

from . import services

router = Router(tags=["plan"])


class LayoutIn(Body):
    config: Any = None
    cluster: Any = None


class SearchIn(Body):
    model: Any = None
    cluster: Any = None
    global_batch: Any = None
    seq_len: Any = None
    precision: Any = "bf16"
    limit: Any = 20
    runnable_only: Any = False


class ExportIn(Body):
    config: Any = None
    format: str | None = None
    cluster: Any = None


class ExportWarning(Schema):
    field: str
    message: str


class RuntimeEstimate(Schema):
    runtime: str
    step_s: float
    tokens_per_s: float
    peak_bytes: float
    fits: bool


class ExportOut(Schema):
    format: str
    text: str
    warnings: list[ExportWarning]
    defaults: dict[str, Any]
    estimates: dict[str, RuntimeEstimate] | None = None
    """With a cluster: the layout priced for loom's trainer and for the trainer it is exported to."""


def answer(compute):
    """200 with what `compute` returns, or 400 with its field errors."""
    try:
        return Status(200, compute())
    except ConfigError as error:
        return Status(400, {"errors": error.errors})


@router.get("/catalog", response=dict)
def catalog(request):
    """Model presets, GPU types (memory, peak TFLOP/s) and pipeline schedules."""
    return services.catalog()


@router.post("/estimate", response={200: dict, 400: FieldErrors})
def estimate(request, body: LayoutIn):
    """Memory per pipeline rank, step time and its parts, throughput, MFU, schedule timeline, warnings."""
    return answer(lambda: services.estimate_layout(body.config, body.cluster))


@router.post("/search", response={200: dict, 400: FieldErrors})
def search(request, body: SearchIn):
    """The fastest layouts that fit, ranked, and the memory/throughput Pareto front; with runnable_only,
    of the layouts loom's trainer runs today."""
    return answer(
        lambda: services.search_layouts(
            body.model, body.cluster, body.global_batch, body.seq_len, body.precision, body.limit, body.runnable_only
        )
    )


# A plain dict: a 1,024-rank matrix is a million numbers, not worth a schema's validation pass.
@router.post("/traffic", response={200: dict, 400: FieldErrors})
def traffic(request, body: LayoutIn):
    """The predicted rank × rank bytes of one step: {world_size, bytes[src][dst], by_kind{kind: matrix}}."""
    return answer(lambda: services.predicted_traffic(body.config, body.cluster))


@router.post("/export", response={200: ExportOut, 400: FieldErrors})
def export(request, body: ExportIn):
    """The layout as a torchtitan TOML file or Megatron-LM command-line arguments, and warnings
    ({field, message}) about what it carries over as is (a demo learning rate); with a cluster, its step
    time and peak memory priced for loom's trainer and for the one it is exported to."""
    return answer(lambda: services.export_layout(body.config, body.format, body.cluster))
