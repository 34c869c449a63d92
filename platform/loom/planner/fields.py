"""The designer's inputs: which run-config and cluster fields the page asks for, labelled and
explained by the schemas themselves, and the layout the page opens with."""

import typing
from typing import Literal

from loom.runs.forms import CONFIG_LABELS, MODEL_SHAPE_PATHS, PARALLEL_PATHS, config_field, form_value
from trainer.plan.defaults import planning_defaults
from trainer.plan.hardware import GPU_TYPES, ClusterSpec
from trainer.plan.presets import preset_model

CLUSTER_PREFIX = "cluster."
CLUSTER_LABELS = {"cluster.gpu": "GPU", "cluster.nodes": "Nodes", "cluster.gpus_per_node": "GPUs per node"}
# Fields only the designer asks for; the new-run form's labels cover the rest.
PLANNER_LABELS = {
    "model.rope_theta": "RoPE base (theta)",
    "data.global_batch": "Global batch (sequences per step; empty: one pass)",
    "model.moe.gate": "Gate",
    "model.moe.renormalize": "Renormalize the top-k gates",
    "model.moe.balance_loss": "Balance loss weight",
    "model.moe.bias_update_rate": "Balancing bias update rate",
    "model.moe.capacity_factor": "Expert capacity factor (empty: dropless)",
    "model.moe.shared_expert": "Shared expert",
    "model.moe.dense_layers": "Dense blocks first",
    "model.moe.dense_ffn": "Their feed-forward size (empty: ffn)",
}

# (section heading, [field path]): paths under "cluster." are ClusterSpec fields, the others
# run-config fields. Beyond what the new-run form asks, the designer offers what the planner
# estimates, some of which the trainer does not run yet (expert parallelism across replicas, offload, …).
DESIGN_SECTIONS = [
    (
        "Model",
        [
            *MODEL_SHAPE_PATHS,
            "model.vocab",
            "model.rope_theta",
            "model.mlp",
            "model.tie_embeddings",
            "model.parallel_blocks",
            "model.experts",
            "model.top_k",
            "model.moe.gate",
            "model.moe.renormalize",
            "model.moe.balance_loss",
            "model.moe.bias_update_rate",
            "model.moe.capacity_factor",
            "model.moe.shared_expert",
            "model.moe.dense_layers",
            "model.moe.dense_ffn",
        ],
    ),
    ("Parallelism", [*PARALLEL_PATHS, "parallel.zero_stage", "parallel.ep"]),
    (
        "Compute and data",
        [
            "compute.precision",
            "compute.recompute",
            "compute.recompute_every",
            "data.micro_batch",
            "data.global_batch",
            "steps",
        ],
    ),
    ("Cluster", list(CLUSTER_LABELS)),
]

STARTING_PRESET = "llama3-8b"
# The preset on the default cluster with the planner's defaults: what the CLI and the API estimate
# for {"model": {"preset": "llama3-8b"}} alone.
STARTING_VALUES = {
    **planning_defaults({"model": {"preset": STARTING_PRESET}}),
    **{f"model.{name}": value for name, value in preset_model(STARTING_PRESET).model_dump().items()},
}


def design_sections() -> list[tuple[str, list[dict]]]:
    """(heading, inputs) for the template; each input is a dict the template and design.js read."""
    return [(heading, [design_input(path) for path in paths]) for heading, paths in DESIGN_SECTIONS]


def design_input(path: str) -> dict:
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
        "label": (CONFIG_LABELS | CLUSTER_LABELS | PLANNER_LABELS)[path],
        "help": field.description,
        "value": "" if value is None else form_value(value),
        "options": options,
        "type": value_type,
        "optional": optional,
    }


def schema_field(path: str):
    """The pydantic FieldInfo behind "parallel.tp" (RunConfig) or "cluster.gpu" (ClusterSpec)."""
    if path.startswith(CLUSTER_PREFIX):
        return ClusterSpec.model_fields[path.removeprefix(CLUSTER_PREFIX)]
    return config_field(path)


def choices_of(path: str, annotation) -> list:
    if path == "cluster.gpu":
        return list(GPU_TYPES)
    if annotation is bool:
        return [True, False]
    if typing.get_origin(annotation) is Literal:
        return list(typing.get_args(annotation))
    return []
