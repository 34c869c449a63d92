"""Datasets, imported models and checkpoint exports: each user's own, refused field by field."""

from typing import Any

from ninja import Router, Status

from loom.api.errors import Body, FieldErrors

from . import services
from .models import CheckpointExport, PretrainedModel

router = Router(tags=["datasets"])


class RegisterIn(Body):
    name: Any = None
    # A directory `python -m trainer.data prepare` wrote, inside one of LOOM_DATA_ROOTS.
    path: Any = None


class ImportIn(Body):
    name: Any = None
    # A Hugging Face Llama directory (config.json and safetensors), inside one of LOOM_DATA_ROOTS.
    path: Any = None


class ExportIn(Body):
    dtype: Any = "float32"


def model_out(model: PretrainedModel) -> dict:
    return {
        "id": model.pk,
        "reference": model.reference,
        "name": model.name,
        "source_path": model.source_path,
        "checkpoint_path": model.checkpoint_path,
        "model_config": model.model_config,
        "state": model.state,
        "error": model.error,
        "created_at": model.created_at.isoformat(),
        "finished_at": model.finished_at.isoformat() if model.finished_at else None,
        "runs": list(model.runs.order_by("-created_at", "-id").values("id", "name", "state")),
    }


def export_out(export: CheckpointExport) -> dict:
    return {
        "id": export.pk,
        "checkpoint": export.checkpoint_id,
        "run": export.checkpoint.run_id,
        "step": export.checkpoint.step,
        "dtype": export.dtype,
        "state": export.state,
        "out_path": export.out_path,
        "error": export.error,
        "requested_at": export.requested_at.isoformat(),
        "finished_at": export.finished_at.isoformat() if export.finished_at else None,
    }


@router.get("/datasets")
def list_datasets(request):
    """Your registered datasets, newest first: tokens and documents per split, tokenizer, shards."""
    return [services.dataset_summary(dataset) for dataset in services.datasets_for(request.user)]


@router.post("/datasets", response={201: dict, 400: FieldErrors})
def register_dataset(request, body: RegisterIn):
    """Register a prepared dataset by its directory; a run names it as data.dataset = "dataset:<id>"."""
    try:
        dataset = services.register_dataset(request.user, body.name, body.path)
    except services.InputError as error:
        return Status(400, {"errors": error.errors})
    return Status(201, services.dataset_detail(dataset))


@router.get("/datasets/{dataset_id}")
def dataset_detail(request, dataset_id: int):
    """The dataset's summary, a few decoded training sequences, and the runs that trained on it."""
    return services.dataset_detail(services.dataset_for(request.user, dataset_id))


@router.get("/models")
def list_models(request):
    """Your imported models, newest first, with their import's state."""
    return [model_out(model) for model in services.models_for(request.user)]


@router.post("/models", response={202: dict, 400: FieldErrors})
def import_model(request, body: ImportIn):
    """Import a Hugging Face Llama directory: a worker converts it once into a loom checkpoint (state queued →
    converting → ready or failed); a run starts from it with checkpoint.init_from = "model:<id>"."""
    try:
        model = services.import_model(request.user, body.name, body.path)
    except services.InputError as error:
        return Status(400, {"errors": error.errors})
    return Status(202, model_out(model))


@router.get("/models/{model_id}")
def model_detail(request, model_id: int):
    """One imported model: its state, its model config once converted, and the runs started from it."""
    return model_out(services.model_for(request.user, model_id))


@router.post("/checkpoints/{checkpoint_id}/export", response={202: dict, 400: FieldErrors})
def export_checkpoint(request, checkpoint_id: int, body: ExportIn):
    """Write a committed checkpoint of yours in Hugging Face's format (config.json and safetensors, loadable by
    transformers); a worker does it (state queued → converting → ready, with out_path, or failed)."""
    try:
        export = services.request_export(request.user, checkpoint_id, body.dtype)
    except services.InputError as error:
        return Status(400, {"errors": error.errors})
    return Status(202, export_out(export))


@router.get("/exports")
def list_exports(request):
    """Your checkpoint exports, newest first."""
    return [export_out(export) for export in services.exports_for(request.user)]


@router.get("/exports/{export_id}")
def export_detail(request, export_id: int):
    """One export: its state and, once ready, the directory it was written to."""
    return export_out(services.export_for(request.user, export_id))
