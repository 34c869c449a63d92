"""The new-run form: the config fields a user sets on the page, labelled and explained by the schema."""

import json
import typing
from typing import Literal

from django import forms

from loom.datasets.services import source_choices
from trainer.config import RunConfig

# How the pages label the run-config fields they ask for; each field's schema description is its help.
CONFIG_LABELS = {
    "steps": "Steps",
    "model.layers": "Layers",
    "model.dim": "Hidden size (dim)",
    "model.heads": "Attention heads",
    "model.kv_heads": "Key/value heads",
    "model.ffn": "Feed-forward size",
    "model.vocab": "Vocabulary",
    "model.seq_len": "Sequence length",
    "model.mlp": "Feed-forward block",
    "model.tie_embeddings": "Tied embeddings",
    "model.parallel_blocks": "Parallel attention and MLP",
    "model.experts": "Experts",
    "model.top_k": "Experts per token",
    "parallel.dp_replicate": "Data-parallel replicas",
    "parallel.dp_shard": "FSDP shards",
    "parallel.zero_stage": "ZeRO stage",
    "parallel.tp": "Tensor parallel",
    "parallel.sequence_parallel": "Sequence parallel",
    "parallel.pp": "Pipeline stages (ranks)",
    "parallel.pp_schedule": "Pipeline schedule",
    "parallel.stages_per_rank": "Stages per pipeline rank",
    "parallel.microbatches": "Pipeline microbatches",
    "parallel.cp": "Context parallel",
    "parallel.ep": "Expert parallel",
    "compute.precision": "Precision",
    "compute.recompute": "Activation recompute",
    "compute.recompute_every": "Recompute every N-th block",
    "optimizer.lr": "Learning rate",
    "optimizer.warmup_steps": "Warmup steps",
    "data.micro_batch": "Micro-batch (sequences per data-parallel rank)",
    "data.global_batch": "Global batch (sequences per step; empty: one pass)",
    "data.document_mask": "Attention within documents",
    "data.corpus_bytes": "Corpus bytes",
    "eval.interval_steps": "Validation loss every (steps; 0: never)",
    "eval.batches": "Validation batches",
    "data.dataset": "Dataset",
    "checkpoint.init_from": "Start from",
    "checkpoint.interval_steps": "Save a checkpoint every (steps)",
    "checkpoint.keep_last": "Checkpoints kept",
    "restart.max_restarts": "Automatic restarts",
}
# The model's shape and the parallel layout as every page that designs a run asks for them.
MODEL_SHAPE_PATHS = ["model.layers", "model.dim", "model.heads", "model.kv_heads", "model.ffn", "model.seq_len"]
PARALLEL_PATHS = [
    "parallel.dp_replicate",
    "parallel.dp_shard",
    "parallel.tp",
    "parallel.sequence_parallel",
    "parallel.pp",
    "parallel.pp_schedule",
    "parallel.stages_per_rank",
    "parallel.microbatches",
    "parallel.cp",
]
# (section heading, [config path]): the subset of the run config the page asks for; everything
# else keeps its schema default.
CONFIG_SECTIONS = [
    ("Training", ["steps"]),
    ("Model", MODEL_SHAPE_PATHS),
    ("Parallelism", PARALLEL_PATHS),
    ("Compute", ["compute.precision"]),
    ("Optimizer", ["optimizer.lr", "optimizer.warmup_steps"]),
    (
        "Data",
        [
            "data.dataset",
            "model.vocab",
            "data.micro_batch",
            "data.global_batch",
            "data.document_mask",
            "data.corpus_bytes",
        ],
    ),
    ("Validation", ["eval.interval_steps", "eval.batches"]),
    (
        "Checkpoints",
        ["checkpoint.init_from", "checkpoint.interval_steps", "checkpoint.keep_last", "restart.max_restarts"],
    ),
]
# Chosen among the user's own objects, by reference; left empty, the config does not name one.
SOURCE_CHOICES_EMPTY = {
    "data.dataset": "the demo corpus (Python's standard library, byte-level)",
    "checkpoint.init_from": "fresh weights",
}

CONFIG_PATHS = frozenset(path for _, paths in CONFIG_SECTIONS for path in paths)


def config_field(path: str):
    """The pydantic FieldInfo behind a dotted config path such as "model.heads"."""
    section_model = RunConfig
    *sections, name = path.split(".")
    for section in sections:
        section_model = section_model.model_fields[section].annotation
    return section_model.model_fields[name]


def config_input(path: str) -> forms.Field:
    """A text input, not a number input: the raw text goes to the schema, the one place that
    decides what is valid, so "abc" or "1.5" for an integer gets the schema's own message.
    Fields with a fixed set of values (schedules, switches) are a select of exactly those."""
    field, label = config_field(path), CONFIG_LABELS[path]
    choices = choices_of(field)
    if choices:
        return forms.ChoiceField(
            label=label, required=False, initial=form_value(field.default), help_text=field.description,
            choices=[(choice, choice) for choice in choices],
        )  # fmt: skip
    input_mode = "numeric" if field.annotation in (int, int | None) else "decimal"
    return forms.CharField(
        label=label,
        required=False,
        initial="" if field.default is None else form_value(field.default),
        help_text=field.description,
        widget=forms.TextInput(attrs={"inputmode": input_mode, "autocomplete": "off"}),
    )


def form_value(value) -> str:
    """How a value is written in an input: JSON's spelling for booleans."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def choices_of(field) -> list[str]:
    if field.annotation is bool:
        return ["true", "false"]
    return (
        [str(value) for value in typing.get_args(field.annotation)]
        if typing.get_origin(field.annotation) is Literal
        else []
    )


class NewRunForm(forms.Form):
    """Collects the inputs as typed and shows the service's verdict on them; it checks nothing itself."""

    name = forms.CharField(label="Name", required=False, widget=forms.TextInput(attrs={"autofocus": True}))

    def __init__(self, *args, user=None, **kwargs):
        super().__init__(*args, **kwargs)
        for _, paths in CONFIG_SECTIONS:
            for path in paths:
                self.fields[path] = config_input(path)
        choices = source_choices(user) if user is not None else {}
        for path, empty in SOURCE_CHOICES_EMPTY.items():
            self.fields[path] = forms.ChoiceField(
                label=CONFIG_LABELS[path],
                required=False,
                initial="",
                help_text=config_field(path).description,
                choices=[("", empty), *choices.get(path, [])],
            )

    def sections(self):
        """(heading, bound fields) for the template to lay out as fieldsets."""
        return [(heading, [self[path] for path in paths]) for heading, paths in CONFIG_SECTIONS]

    def run_input(self) -> tuple[str | None, dict]:
        """The name and the nested run-config document, values exactly as typed."""
        document: dict = {}
        for path in CONFIG_PATHS:
            # An empty choice of source, or an empty optional number: the config leaves the field at null.
            if config_field(path).default is None and not self[path].value():
                continue
            *sections, name = path.split(".")
            target = document
            for section in sections:
                target = target.setdefault(section, {})
            target[name] = typed_value(self[path].value())
        return self["name"].value(), document

    def add_input_errors(self, errors: dict[str, str]) -> None:
        """Put each of RunInputError's messages next to its input, or atop the form if it has none."""
        for key, message in errors.items():
            field = input_for(key)
            self.add_error(field, message if field else f"{key}: {message}")


def typed_value(text):
    """The JSON value an input's text spells ("4" → 4, "true" → true), as the schema is strict about types;
    any other text goes to it as typed, so its message says what it wanted instead."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return text
    return value if isinstance(value, int | float) else text


def field_label(error_key: str) -> str:
    """How a message keyed by field path names its field on a page: the form's label where it has one."""
    return CONFIG_LABELS.get(error_key.removeprefix("config."), error_key)


def input_for(error_key: str) -> str | None:
    """The input a service error belongs to ("config.model.heads" → "model.heads"); None shows it atop the form."""
    if error_key == "name":
        return "name"
    path = error_key.removeprefix("config.")
    return path if path in CONFIG_PATHS else None


def restore_inputs() -> list[dict]:
    """The run page's restore form: the layout inputs (the rest of the parallel section stays as
    saved), each with its label, help, choices (a select), schema default, which run.js fills in where
    a checkpoint's saved layout lacks the field, and the JSON type its text is sent as."""
    inputs = []
    for path in PARALLEL_PATHS:
        field = config_field(path)
        choices = choices_of(field)
        inputs.append(
            {
                "path": path,
                "id": "restore-" + path.replace(".", "-"),
                "label": CONFIG_LABELS[path],
                "help": field.description,
                "default": form_value(field.default),
                "options": choices,
                "type": "bool" if field.annotation is bool else "text" if choices else "number",
            }
        )
    return inputs
