"""`loom plan`: the planner on this machine, no platform needed. The arithmetic and the reports are
trainer.plan's own (python -m trainer.plan prints the same); these commands also read YAML."""

import json
from pathlib import Path
from typing import Annotated

import typer

from trainer.plan.__main__ import describe_search, estimate_text, export_text, model_of
from trainer.plan.hardware import GPU_TYPES
from trainer.plan.layout import RUNTIMES
from trainer.plan.presets import MODEL_PRESETS
from trainer.plan.search import search

from .documents import load_document
from .exit_codes import reports_errors

plan_app = typer.Typer(no_args_is_help=True, help="Estimate, search and export layouts locally (trainer.plan).")

ClusterFile = Annotated[Path | None, typer.Option("--cluster", help="cluster description, YAML or JSON")]
Gpu = Annotated[str | None, typer.Option(help=f"GPU type: {', '.join(GPU_TYPES)}")]
Nodes = Annotated[int | None, typer.Option(help="nodes in the cluster")]
GpusPerNode = Annotated[int | None, typer.Option(help="GPUs per node")]
AsJson = Annotated[bool, typer.Option("--json", help="print JSON, as the API answers")]


def cluster_of(file: Path | None, gpu: str | None, nodes: int | None, gpus_per_node: int | None) -> dict:
    """The cluster file's fields, those given as options on top."""
    flags = {"gpu": gpu, "nodes": nodes, "gpus_per_node": gpus_per_node}
    cluster = load_document(file) if file else {}
    return {**cluster, **{name: value for name, value in flags.items() if value is not None}}


@plan_app.command()
@reports_errors
def estimate(
    file: Annotated[Path, typer.Argument(help="run-config document, YAML or JSON")],
    cluster: ClusterFile = None,
    gpu: Gpu = None,
    nodes: Nodes = None,
    gpus_per_node: GpusPerNode = None,
    runtime: Annotated[str, typer.Option(help=f"whose trainer runs it: {', '.join(RUNTIMES)}")] = "loom",
    as_json: AsJson = False,
):
    """Memory per GPU, step time and throughput of one layout."""
    document = load_document(file)
    typer.echo(estimate_text(document, cluster_of(cluster, gpu, nodes, gpus_per_node), runtime, as_json))


@plan_app.command("search")
@reports_errors
def search_layouts(
    model: Annotated[str, typer.Option(help=f"a preset ({', '.join(MODEL_PRESETS)}) or a JSON model section")],
    global_batch: Annotated[int, typer.Option(help="sequences per optimizer step")],
    cluster: ClusterFile = None,
    gpu: Gpu = None,
    nodes: Nodes = None,
    gpus_per_node: GpusPerNode = None,
    seq_len: Annotated[int | None, typer.Option(help="tokens per sequence (default: the model's)")] = None,
    precision: Annotated[str, typer.Option(help="bf16, fp8 or fp32")] = "bf16",
    limit: Annotated[int, typer.Option(help="how many of the fastest layouts to list")] = 10,
    runnable_only: Annotated[bool, typer.Option(help="only layouts loom's trainer runs today")] = False,
    as_json: AsJson = False,
):
    """The fastest layouts that fit, and the memory/speed frontier."""
    result = search(
        model_of(model),
        cluster_of(cluster, gpu, nodes, gpus_per_node),
        global_batch,
        seq_len=seq_len,
        precision=precision,
        limit=limit,
        runnable_only=runnable_only,
    )
    typer.echo(json.dumps(result.to_json(), indent=2) if as_json else describe_search(result))


@plan_app.command()
@reports_errors
def export(
    file: Annotated[Path, typer.Argument(help="run-config document, YAML or JSON")],
    format: Annotated[str, typer.Option("--format", help="torchtitan or megatron")],
):
    """The layout as a torchtitan job or Megatron-LM arguments (warnings on stderr)."""
    typer.echo(export_text(load_document(file), format))
