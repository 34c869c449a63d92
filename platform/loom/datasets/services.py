"""Datasets, imported models and checkpoint exports: registering and listing them for their owner, and the jobs a
worker runs (converting a Hugging Face model, exporting a checkpoint). Paths a user gives must resolve inside
LOOM_DATA_ROOTS; one user never reaches another's objects (someone else's answers like a missing one)."""

import os
import unicodedata
from pathlib import Path

from celery import current_app
from django.conf import settings
from django.db import IntegrityError, transaction
from django.http import Http404
from django.utils import timezone

from loom.checkpoints.models import COMMITTED, Checkpoint
from trainer.data.format import SPLITS, DatasetError, PreparedDataset

from .models import CONVERTING, FAILED, QUEUED, READY, CheckpointExport, Dataset, PretrainedModel

# Celery task names (tasks.py), sent by name: the tasks import torch, which only a worker loads.
IMPORT_TASK = "loom.datasets.import_model"
EXPORT_TASK = "loom.datasets.export_checkpoint"
SAMPLE_COUNT = 3
SAMPLE_TOKENS = 96
EXPORT_DTYPES = ("float32", "bfloat16", "float16")


class InputError(ValueError):
    """Bad user input; `errors` maps each field to what was wrong and what would be right."""

    def __init__(self, errors: dict[str, str]):
        super().__init__("; ".join(f"{field}: {message}" for field, message in errors.items()))
        self.errors = errors


def data_roots() -> list[Path]:
    return [Path(os.path.realpath(root)) for root in settings.LOOM_DATA_ROOTS]


def _inside_roots(resolved: Path) -> bool:
    return any(resolved == root or root in resolved.parents for root in data_roots())


def path_inside_roots(path, field: str) -> Path:
    """`path` resolved, symlinks followed, when it is a directory inside one of LOOM_DATA_ROOTS; else InputError
    keyed by `field` naming the roots."""
    if not isinstance(path, str) or not path.strip():
        raise InputError({field: "is required: the absolute path of a directory on the platform's machine"})
    if any(unicodedata.category(char) == "Cc" for char in path):
        raise InputError({field: "must not contain control characters"})
    if not os.path.isabs(path):
        raise InputError({field: f"must be an absolute path, not {path!r}"})
    resolved = Path(os.path.realpath(path))
    if not _inside_roots(resolved):
        listed = ", ".join(str(root) for root in data_roots())
        raise InputError({field: f"must lie inside one of the data roots ({listed}), symlinks followed"})
    if not resolved.is_dir():
        raise InputError({field: f"{path} is not a directory"})
    return resolved


def _clean_name(name) -> str:
    if not isinstance(name, str) or not name.strip():
        raise InputError({"name": "is required"})
    if len(name.strip()) > 200:
        raise InputError({"name": "must be at most 200 characters"})
    if any(unicodedata.category(char) == "Cc" for char in name):
        raise InputError({"name": "must not contain control characters"})
    return name.strip()


# Datasets.


def _file_inside(directory: Path, name) -> Path:
    """A file the manifest names, which must be a plain name inside the dataset's own directory."""
    if not isinstance(name, str) or not name or Path(name).name != name:
        raise DatasetError(f"the manifest names {name!r}, which is no file name inside the dataset's directory")
    path = directory / name
    real = Path(os.path.realpath(path))
    if real.parent != directory or not real.is_file():
        raise DatasetError(f"{name} is missing, or a link out of the dataset's directory")
    return real


def checked_dataset(directory: Path) -> PreparedDataset:
    """The prepared dataset in `directory`, every file its manifest names present inside it at its full size."""
    try:
        dataset = PreparedDataset.open(directory)
        manifest = dataset.manifest
        tokenizer = manifest["tokenizer"]
        if tokenizer.get("file"):
            _file_inside(directory, tokenizer["file"])
        for split in SPLITS:
            for shard in manifest["splits"][split]["shards"]:
                size = _file_inside(directory, shard["file"]).stat().st_size
                expected = int(shard["tokens"]) * dataset.dtype.itemsize
                if size != expected:
                    raise DatasetError(f"{shard['file']} holds {size} bytes, its manifest says {expected}")
        int(dataset.vocab_size), int(dataset.eot_id)
    except (KeyError, TypeError, ValueError) as error:
        raise DatasetError(f"manifest.json lacks what a prepared dataset's has ({error!r})") from None
    return dataset


def register_dataset(owner, name, path) -> Dataset:
    """Register the prepared dataset in `path` (inside LOOM_DATA_ROOTS) as `owner`'s, summarising its manifest."""
    errors: dict[str, str] = {}
    clean = resolved = None
    try:
        clean = _clean_name(name)
    except InputError as error:
        errors |= error.errors
    try:
        resolved = path_inside_roots(path, "path")
        prepared = checked_dataset(resolved)
    except InputError as error:
        errors |= error.errors
    except DatasetError as error:
        errors["path"] = f"is not a prepared dataset: {error}"
    if errors:
        raise InputError(errors)
    manifest = prepared.manifest
    splits = manifest["splits"]
    try:
        with transaction.atomic():
            return Dataset.objects.create(
                owner=owner,
                name=clean,
                path=str(resolved),
                vocab_size=prepared.vocab_size,
                tokenizer_kind=str(manifest["tokenizer"].get("kind", "")),
                tokenizer_sha256=str(manifest["tokenizer"].get("sha256") or ""),
                train_tokens=prepared.tokens("train"),
                validation_tokens=prepared.tokens("validation"),
                train_documents=int(splits["train"].get("documents", 0)),
                validation_documents=int(splits["validation"].get("documents", 0)),
                shards=sum(len(splits[split]["shards"]) for split in SPLITS),
            )
    except IntegrityError:
        raise InputError({"name": f"you already have a dataset named {clean!r}; choose another name"}) from None


def datasets_for(user):
    return Dataset.objects.filter(owner=user)


def dataset_for(user, dataset_id: int) -> Dataset:
    dataset = Dataset.objects.filter(owner=user, pk=dataset_id).first()
    if dataset is None:
        raise Http404("no such dataset")
    return dataset


def samples(dataset: Dataset, count: int = SAMPLE_COUNT, tokens: int = SAMPLE_TOKENS) -> list[dict]:
    """A few training sequences as the ranks read them, from evenly spaced places of the train split: each with
    where it starts, its token ids and its text."""
    # Checked again as it is read: what the page shows must still come from inside the data roots.
    prepared = checked_dataset(path_inside_roots(dataset.path, "path"))
    shards = prepared.shards("train")
    total = sum(len(shard) for shard in shards)
    length = min(tokens, total)
    stride = (total - length) // max(1, count - 1)
    starts = sorted({index * stride for index in range(count)}) if length else []
    picked = []
    for start in starts:
        ids = _read(shards, start, length)
        picked.append({"start": start, "tokens": ids, "text": prepared.decode(ids)})
    return picked


def _read(shards, start: int, length: int) -> list[int]:
    ids: list[int] = []
    for shard in shards:
        if start >= len(shard):
            start -= len(shard)
            continue
        piece = shard[start : start + length - len(ids)]
        ids += [int(token) for token in piece]
        start = 0
        if len(ids) == length:
            break
    return ids


def dataset_detail(dataset: Dataset) -> dict:
    """The dataset's summary, a few decoded sample sequences (or why they cannot be read now) and the runs that
    trained on it."""
    try:
        sampled, problem = samples(dataset), ""
    except (DatasetError, OSError, ValueError) as error:
        sampled, problem = [], f"the dataset cannot be read now: {error}"
    runs = dataset.runs.order_by("-created_at", "-id").values("id", "name", "state")
    return {**dataset_summary(dataset), "samples": sampled, "samples_problem": problem, "runs": list(runs)}


def dataset_summary(dataset: Dataset) -> dict:
    return {
        "id": dataset.pk,
        "reference": dataset.reference,
        "name": dataset.name,
        "path": dataset.path,
        "vocab_size": dataset.vocab_size,
        "tokenizer": {"kind": dataset.tokenizer_kind, "sha256": dataset.tokenizer_sha256},
        "splits": {
            "train": {"tokens": dataset.train_tokens, "documents": dataset.train_documents},
            "validation": {"tokens": dataset.validation_tokens, "documents": dataset.validation_documents},
        },
        "shards": dataset.shards,
        "registered_at": dataset.registered_at.isoformat(),
    }


# Imported models.


def confined_model_directory(path) -> Path:
    """A Hugging Face directory inside the data roots whose every entry resolves inside them too: a weights file
    linked to elsewhere is refused, at the request and again when the worker reads it (a link placed since)."""
    resolved = path_inside_roots(path, "path")
    for entry in sorted(resolved.iterdir()):
        if not _inside_roots(Path(os.path.realpath(entry))):
            raise InputError({"path": f"{entry.name} is a link out of the data roots; copy the file in instead"})
    return resolved


def import_model(owner, name, path) -> PretrainedModel:
    """Queue converting the Hugging Face directory `path` (inside LOOM_DATA_ROOTS) into a loom checkpoint."""
    errors: dict[str, str] = {}
    clean = source = None
    try:
        clean = _clean_name(name)
    except InputError as error:
        errors |= error.errors
    try:
        source = confined_model_directory(path)
        if not (source / "config.json").is_file():
            errors["path"] = "holds no config.json: give the directory save_pretrained wrote"
    except InputError as error:
        errors |= error.errors
    if errors:
        raise InputError(errors)
    with transaction.atomic():
        model = PretrainedModel.objects.create(owner=owner, name=clean, source_path=str(source))
        transaction.on_commit(lambda: current_app.send_task(IMPORT_TASK, args=[model.pk]), robust=True)
    return model


def models_for(user):
    return PretrainedModel.objects.filter(owner=user)


def model_for(user, model_id: int) -> PretrainedModel:
    model = PretrainedModel.objects.filter(owner=user, pk=model_id).first()
    if model is None:
        raise Http404("no such model")
    return model


def _claim(queryset) -> bool:
    """Move a queued job to converting; False when another delivery took it already."""
    return bool(queryset.filter(state=QUEUED).update(state=CONVERTING))


def convert_model(model_id: int, convert) -> None:
    """The worker's half of an import: `convert(source, out_dir)` (trainer.hf.importing.import_model) writes the
    checkpoint and returns its model config; a failure is recorded, in words, on the model."""
    if not _claim(PretrainedModel.objects.filter(pk=model_id)):
        return
    model = PretrainedModel.objects.get(pk=model_id)
    out_dir = Path(settings.LOOM_MODELS_DIR) / f"model-{model.pk}"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        config = convert(confined_model_directory(model.source_path), out_dir)
    except Exception as error:  # noqa: BLE001 - whatever failed, the model says so instead of staying converting
        _finish(PretrainedModel.objects.filter(pk=model_id), FAILED, error=f"{type(error).__name__}: {error}")
        return
    _finish(PretrainedModel.objects.filter(pk=model_id), READY, checkpoint_path=str(out_dir), model_config=config)


def _finish(queryset, state: str, **fields) -> None:
    queryset.update(state=state, finished_at=timezone.now(), **fields)


# Exports.


def request_export(user, checkpoint_id, dtype="float32") -> CheckpointExport:
    """Queue writing a committed checkpoint of the user's in Hugging Face's format."""
    checkpoint = Checkpoint.objects.filter(run__owner=user, pk=checkpoint_id).first()
    if checkpoint is None:
        raise Http404("no such checkpoint")
    errors = {}
    if checkpoint.state != COMMITTED:
        errors["checkpoint"] = f"is {checkpoint.state} ({checkpoint.problem}); only a committed one can be exported"
    if dtype not in EXPORT_DTYPES:
        errors["dtype"] = f"must be one of {', '.join(EXPORT_DTYPES)}"
    if errors:
        raise InputError(errors)
    with transaction.atomic():
        export = CheckpointExport.objects.create(checkpoint=checkpoint, requested_by=user, dtype=dtype)
        transaction.on_commit(lambda: current_app.send_task(EXPORT_TASK, args=[export.pk]), robust=True)
    return export


def exports_for(user):
    return CheckpointExport.objects.filter(requested_by=user, checkpoint__run__owner=user).select_related("checkpoint")


def export_for(user, export_id: int) -> CheckpointExport:
    export = exports_for(user).filter(pk=export_id).first()
    if export is None:
        raise Http404("no such export")
    return export


def run_export(export_id: int, export) -> None:
    """The worker's half of an export: `export(checkpoint_dir, out_dir, tokenizer_dir, dtype)`
    (trainer.hf.exporting), with the tokenizer of the dataset the checkpoint's run trained on, if any."""
    if not _claim(CheckpointExport.objects.filter(pk=export_id)):
        return
    job = CheckpointExport.objects.select_related("checkpoint__run__dataset").get(pk=export_id)
    out_dir = Path(settings.LOOM_EXPORTS_DIR) / f"export-{job.pk}"
    dataset = job.checkpoint.run.dataset
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tokenizer_dir = Path(dataset.path) if dataset is not None else None
        written = export(Path(job.checkpoint.path), out_dir, tokenizer_dir, dtype=job.dtype)
    except Exception as error:  # noqa: BLE001 - whatever failed, the export says so instead of staying converting
        _finish(CheckpointExport.objects.filter(pk=export_id), FAILED, error=f"{type(error).__name__}: {error}")
        return
    _finish(CheckpointExport.objects.filter(pk=export_id), READY, out_path=str(written or out_dir))


# What a new run may read and start from.

INIT_CHECKPOINT_CHOICES = 50


def source_choices(user) -> dict[str, list[tuple[str, str]]]:
    """The user's datasets ("data.dataset") and starting weights ("checkpoint.init_from": imported models that
    are ready, then their newest committed checkpoints) as (reference, label) for a page's choosers."""
    datasets = [
        (dataset.reference, f"{dataset.name} ({dataset.train_tokens:,} train tokens, vocabulary {dataset.vocab_size})")
        for dataset in datasets_for(user)
    ]
    models = [(model.reference, f"{model.name} (imported model)") for model in models_for(user).filter(state=READY)]
    committed = (
        Checkpoint.objects.filter(run__owner=user, state=COMMITTED)
        .select_related("run")
        .order_by("-committed_at", "-id")[:INIT_CHECKPOINT_CHOICES]
    )
    checkpoints = [
        (f"checkpoint:{checkpoint.pk}", f"run {checkpoint.run_id} {checkpoint.run.name}, step {checkpoint.step}")
        for checkpoint in committed
    ]
    return {"data.dataset": datasets, "checkpoint.init_from": models + checkpoints}


def model_sections(user) -> dict[str, dict]:
    """The model section each choice of starting weights needs, by reference: a page fills the shape in from it."""
    sections = {model.reference: model.model_config for model in models_for(user).filter(state=READY)}
    committed = Checkpoint.objects.filter(run__owner=user, state=COMMITTED).select_related("attempt")
    for checkpoint in committed.order_by("-committed_at", "-id")[:INIT_CHECKPOINT_CHOICES]:
        sections[f"checkpoint:{checkpoint.pk}"] = checkpoint.attempt.config.get("model", {})
    return sections


def designer_sources(user) -> dict:
    """What the designer's choosers offer and how a choice fills the form: datasets and starting weights as
    (reference, label), each choice of weights' model section, and each dataset's vocabulary size."""
    choices = source_choices(user)
    return {
        "datasets": choices["data.dataset"],
        "initFrom": choices["checkpoint.init_from"],
        "initModels": model_sections(user),
        "datasetVocab": {dataset.reference: dataset.vocab_size for dataset in datasets_for(user)},
    }
