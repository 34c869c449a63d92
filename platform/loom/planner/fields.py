"""The designer's inputs: which run-config and cluster fields the page asks for, labelled and
explained by the schemas themselves, and the layout the page opens with."""

import typing
from typing import Literal

from pydantic import BaseModel

from trainer.config import RunConfig
from trainer.plan.hardware import GPU_TYPES, ClusterSpec
from trainer.plan.presets import MODEL_PRESETS

CLUSTER = "cluster"

# (section heading, [(field path, label)]): paths under "cluster." are ClusterSpec fields, the
# others run-config fields.
DESIGN_SECTIONS = [
    (
        "Model",
        [
            ("model.layers", "Layers"),
            ("model.dim", "Hidden size (dim)"),
            ("model.heads", "Attention heads"),
            ("model.kv_heads", "Key/value heads"),
            ("model.ffn", "Feed-forward size"),
            ("model.vocab", "Vocabulary"),
            ("model.seq_len", "Sequence length"),
            ("model.mlp", "Feed-forward block"),
            ("model.tie_embeddings", "Tied embeddings"),
            ("model.experts", "Experts"),
            ("model.top_k", "Experts per token"),
        ],
    ),
    (
        "Parallelism",
        [
            ("parallel.dp_replicate", "Data-parallel replicas"),
            ("parallel.dp_shard", "FSDP shards"),
            ("parallel.zero_stage", "ZeRO stage"),
            ("parallel.tp", "Tensor parallel"),
            ("parallel.sequence_parallel", "Sequence parallel"),
            ("parallel.pp", "Pipeline stages (ranks)"),
            ("parallel.pp_schedule", "Pipeline schedule"),
            ("parallel.stages_per_rank", "Stages per pipeline rank"),
            ("parallel.microbatches", "Pipeline microbatches"),
            ("parallel.cp", "Context parallel"),
            ("parallel.ep", "Expert parallel"),
        ],
    ),
    (
        "Compute and data",
        [
            ("compute.precision", "Precision"),
            ("compute.recompute", "Activation recompute"),
            ("data.micro_batch", "Micro-batch (sequences per data-parallel rank)"),
            ("steps", "Steps"),
        ],
    ),
    (
        "Cluster",
        [
            ("cluster.gpu", "GPU"),
            ("cluster.nodes", "Nodes"),
            ("cluster.gpus_per_node", "GPUs per node"),
        ],
    ),
]

STARTING_PRESET = "llama3-8b"
STARTING_VALUES = {
    "parallel.dp_shard": 8,
    "compute.precision": "bf16",
    "compute.recompute": "selective",
    "data.micro_batch": 1,
    **{f"model.{name}": value for name, value in MODEL_PRESETS[STARTING_PRESET].items()},
}


def design_sections() -> list[tuple[str, list[dict]]]:
    """(heading, inputs) for the template; each input is a dict the template and design.js read."""
    return [(heading, [design_input(path, label) for path, label in inputs]) for heading, inputs in DESIGN_SECTIONS]


def design_input(path: str, label: str) -> dict:
    """An input's label, help, starting value, choices (a select) and value type, which design.js
    uses to turn the typed text into JSON: numbers as numbers, "" for an optional field as null."""
    field = schema_field(path)
    value = STARTING_VALUES.get(path, field.default)
    annotation = field.annotation
    optional = type(None) in typing.get_args(annotation)
    if optional:
        (annotation,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    choices = choices_of(path, annotation)
    if annotation is bool:
        value_type = "bool"
    elif annotation in (int, float) or (choices and all(isinstance(choice, int) for choice in choices)):
        value_type = "number"
    else:
        value_type = "text"
    options = [("", "auto")] if optional and choices else []
    options += [(form_value(choice), form_value(choice)) for choice in choices]
    return {
        "path": path,
        "id": "design-" + path.replace(".", "-"),
        "label": label,
        "help": field.description,
        "value": "" if value is None else form_value(value),
        "options": options,
        "type": value_type,
    }


def schema_field(path: str):
    """The pydantic FieldInfo behind "parallel.tp" (RunConfig) or "cluster.gpu" (ClusterSpec)."""
    section: type[BaseModel] = RunConfig
    *sections, name = path.split(".")
    if sections[:1] == [CLUSTER]:
        section, sections = ClusterSpec, sections[1:]
    for part in sections:
        section = section.model_fields[part].annotation
    return section.model_fields[name]


def choices_of(path: str, annotation) -> list:
    if path == "cluster.gpu":
        return list(GPU_TYPES)
    if annotation is bool:
        return [True, False]
    if typing.get_origin(annotation) is Literal:
        return list(typing.get_args(annotation))
    return []


def form_value(value) -> str:
    """How a value is written in an input: JSON's spelling for booleans."""
    return str(value).lower() if isinstance(value, bool) else str(value)
