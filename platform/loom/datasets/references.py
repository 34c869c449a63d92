"""What a run config names by reference, "dataset:<id>", "model:<id>" and "checkpoint:<id>": resolved against the
caller's own objects when a run is created, checked against the config's model, and turned into directories only
when an attempt's config is written for its ranks. Someone else's object reads as a missing one."""

import re
from dataclasses import dataclass

from loom.checkpoints.models import COMMITTED, Checkpoint
from trainer.config import RunConfig

from .models import READY, Dataset, PretrainedModel

DATASET_REFERENCE = re.compile(r"^dataset:(\d{1,18})$")
MODEL_REFERENCE = re.compile(r"^model:(\d{1,18})$")
CHECKPOINT_REFERENCE = re.compile(r"^checkpoint:(\d{1,18})$")
# What a model may change from the weights it starts from: no weight depends on the sequence length (RoPE).
FREE_MODEL_FIELDS = frozenset({"seq_len"})


class SourceGone(Exception):
    """A stored config names an object that no longer exists: the attempt cannot be given its directory."""


@dataclass(frozen=True)
class RunSources:
    """What a run reads and starts from, as its config names them; None where it names nothing of the kind."""

    dataset: Dataset | None = None
    pretrained: PretrainedModel | None = None
    init_checkpoint: Checkpoint | None = None

    @property
    def init_model(self) -> dict | None:
        """The model section the starting weights were saved or imported under."""
        if self.pretrained is not None:
            return self.pretrained.model_config
        if self.init_checkpoint is not None:
            return self.init_checkpoint.attempt.config.get("model", {})
        return None


def _section_value(document, section: str, field: str):
    part = document.get(section) if isinstance(document, dict) else None
    return part.get(field) if isinstance(part, dict) else None


def referenced_sources(document, owner) -> tuple[dict[str, str], RunSources]:
    """Field errors for references that name nothing of `owner`'s (or paths where a reference belongs), and the
    objects the others name."""
    errors: dict[str, str] = {}
    dataset = pretrained = checkpoint = None
    reference = _section_value(document, "data", "dataset")
    if isinstance(reference, str):
        if match := DATASET_REFERENCE.match(reference):
            dataset = Dataset.objects.filter(owner=owner, pk=int(match[1])).first() if owner is not None else None
            if dataset is None:
                errors["config.data.dataset"] = f"you have no dataset {match[1]}; register it on the Datasets page"
        else:
            errors["config.data.dataset"] = (
                'cannot be a path: name a dataset you registered, "dataset:<id>", or leave it out for the demo corpus'
            )
    reference = _section_value(document, "checkpoint", "init_from")
    if isinstance(reference, str):
        if match := MODEL_REFERENCE.match(reference):
            found = PretrainedModel.objects.filter(owner=owner, pk=int(match[1])) if owner is not None else None
            pretrained = found.first() if found is not None else None
            if pretrained is None:
                errors["config.checkpoint.init_from"] = f"you have no imported model {match[1]}"
            elif pretrained.state != READY:
                errors["config.checkpoint.init_from"] = (
                    f"model {pretrained.pk} is {pretrained.state}{f' ({pretrained.error})' if pretrained.error else ''}"
                    "; start from a model whose import is ready"
                )
                pretrained = None
        elif match := CHECKPOINT_REFERENCE.match(reference):
            yours = Checkpoint.objects.filter(run__owner=owner) if owner is not None else Checkpoint.objects.none()
            checkpoint = yours.select_related("attempt").filter(pk=int(match[1])).first()
            if checkpoint is None:
                errors["config.checkpoint.init_from"] = f"you have no checkpoint {match[1]}"
            elif checkpoint.state != COMMITTED:
                errors["config.checkpoint.init_from"] = (
                    f"checkpoint {checkpoint.pk} is {checkpoint.state} ({checkpoint.problem}); choose a committed one"
                )
                checkpoint = None
        else:
            errors["config.checkpoint.init_from"] = (
                'cannot be a path: name a committed checkpoint of yours, "checkpoint:<id>", or a model you imported, '
                '"model:<id>"'
            )
    return errors, RunSources(dataset, pretrained, checkpoint)


def with_model_of_weights(document, sources: RunSources):
    """The document with the starting weights' model fields wherever its own model section leaves one out (the
    sequence length aside: a run picks its own), so a config need not restate what the weights fix (an imported
    Llama's norm epsilon or RoPE scaling, which no form asks for)."""
    saved = sources.init_model
    section = document.get("model", {}) if isinstance(document, dict) else None
    if saved is None or not isinstance(section, dict):
        return document
    inherited = {field: value for field, value in saved.items() if field not in FREE_MODEL_FIELDS}
    return {**document, "model": {**inherited, **section}}


def compatibility_errors(config: RunConfig, sources: RunSources) -> dict[str, str]:
    """The config's model against what it reads and starts from: a vocabulary that holds every token id of the
    dataset, and the very shape of the starting weights."""
    errors: dict[str, str] = {}
    dataset = sources.dataset
    if dataset is not None and config.model.vocab < dataset.vocab_size:
        errors["config.model.vocab"] = (
            f"must be at least {dataset.vocab_size}, the size of dataset {dataset.pk}'s tokenizer "
            f"({dataset.tokenizer_kind}), so every token id it holds has an embedding"
        )
    saved = sources.init_model
    if saved is not None:
        ours = config.model.model_dump(mode="json")
        differing = [
            f"{field} is {saved[field]!r} there, {ours[field]!r} here"
            for field in ours
            if field not in FREE_MODEL_FIELDS and field in saved and saved[field] != ours[field]
        ]
        if differing:
            origin = (
                f"model {sources.pretrained.pk}"
                if sources.pretrained is not None
                else f"checkpoint {sources.init_checkpoint.pk}"
            )
            errors["config.checkpoint.init_from"] = (
                f"{origin}'s weights have another model shape: {'; '.join(differing)}; "
                "set the model section to theirs (only seq_len may differ)"
            )
    return errors


def with_directories(config: dict) -> dict:
    """The config as an attempt's ranks read it: each reference replaced by its directory. SourceGone when one
    names an object deleted since the run was created."""
    data = dict(config.get("data", {}))
    checkpoint = dict(config.get("checkpoint", {}))
    reference = data.get("dataset")
    if isinstance(reference, str) and (match := DATASET_REFERENCE.match(reference)):
        path = Dataset.objects.filter(pk=int(match[1])).values_list("path", flat=True).first()
        if path is None:
            raise SourceGone(f"data.dataset names dataset {match[1]}, which was deleted")
        data["dataset"] = path
    reference = checkpoint.get("init_from")
    if isinstance(reference, str):
        if match := MODEL_REFERENCE.match(reference):
            found = PretrainedModel.objects.filter(pk=int(match[1]), state=READY)
            path = found.values_list("checkpoint_path", flat=True).first()
        elif match := CHECKPOINT_REFERENCE.match(reference):
            path = Checkpoint.objects.filter(pk=int(match[1])).values_list("path", flat=True).first()
        else:
            path = reference
        if path is None:
            raise SourceGone(f"checkpoint.init_from names {reference}, which was deleted")
        checkpoint["init_from"] = path
    return {**config, "data": data, "checkpoint": checkpoint}
