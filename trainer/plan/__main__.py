"""The planner from a shell: estimate a layout, search for the best ones, export one to another trainer.

    python -m trainer.plan estimate CONFIG.json [--cluster CLUSTER.json | --gpu H100-SXM --nodes 8 --gpus-per-node 8]
                                    [--json]
    python -m trainer.plan search --model llama3-70b|MODEL.json --gpu H100-SXM --nodes 8 --global-batch 512
                                  [--seq-len N] [--precision bf16] [--limit 10] [--runnable-only] [--json]
    python -m trainer.plan export CONFIG.json --format torchtitan|megatron

CONFIG.json is a run-config document (a model preset allowed: {"model": {"preset": "llama3-70b"}});
fields it leaves out take the planner's defaults (trainer.plan.defaults, the designer's too), which
estimate prints and export lists on stderr. MODEL.json is a model section, or a run config whose model
section is used. Cluster flags override the fields of --cluster. --json prints
`Estimate.to_json(timeline=False)` with the defaults taken, or `SearchResult.to_json()`.
Invalid input exits with status 2 and one "field: message" line per error on stderr; export's
warnings go to stderr too, so its standard output is the job alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from trainer.config import ConfigError, parse_config
from trainer.plan.defaults import planned_estimate, with_planning_defaults
from trainer.plan.estimate import Estimate
from trainer.plan.export import export_job
from trainer.plan.hardware import GIB, GPU_TYPES
from trainer.plan.layout import RUNTIMES
from trainer.plan.presets import MODEL_PRESETS, with_preset
from trainer.plan.search import Found, SearchResult, search

INVALID = 2
MAX_RANK_COLUMNS = 8


def main(argv: list[str] | None = None) -> int:
    arguments = parser().parse_args(argv)
    try:
        output = arguments.run(arguments)
    except ConfigError as error:
        for field, message in error.errors.items():
            print(f"{field}: {message}", file=sys.stderr)
        return INVALID
    try:
        print(output, flush=True)
    except BrokenPipeError:
        # The reader (`| head`) has what it wanted. Python's exit would flush stdout into the closed
        # pipe again and print a traceback, so stdout is pointed at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="python -m trainer.plan", description=__doc__.splitlines()[0])
    commands = root.add_subparsers(required=True, metavar="COMMAND")

    estimating = commands.add_parser("estimate", help="memory, step time and throughput of one layout")
    estimating.add_argument("config", metavar="CONFIG.json", help="run-config document")
    add_cluster_arguments(estimating)
    estimating.add_argument(
        "--runtime",
        default="loom",
        choices=RUNTIMES,
        help="whose trainer runs it: loom's, or one the layout is exported to (they fuse, overlap and recompute "
        "differently)",
    )
    estimating.add_argument("--json", action="store_true", help="print the estimate as JSON")
    estimating.set_defaults(run=run_estimate)

    searching = commands.add_parser("search", help="the fastest layouts that fit, and the memory/speed frontier")
    searching.add_argument(
        "--model",
        required=True,
        metavar="PRESET|MODEL.json",
        help=f"a preset ({', '.join(MODEL_PRESETS)}) or a JSON model section",
    )
    add_cluster_arguments(searching)
    searching.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    searching.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's)")
    searching.add_argument("--precision", default="bf16", choices=("bf16", "fp8", "fp32"))
    searching.add_argument("--limit", type=int, default=10, help="how many of the fastest layouts to list")
    searching.add_argument(
        "--runnable-only",
        action="store_true",
        help="only layouts loom's trainer runs today (no expert parallelism across replicas, say)",
    )
    searching.add_argument("--json", action="store_true", help="print the search result as JSON")
    searching.set_defaults(run=run_search)

    exporting = commands.add_parser("export", help="the layout as a torchtitan job or Megatron-LM arguments")
    exporting.add_argument("config", metavar="CONFIG.json", help="run-config document")
    exporting.add_argument("--format", required=True, choices=("torchtitan", "megatron"))
    exporting.set_defaults(run=run_export)
    return root


def add_cluster_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument("--cluster", metavar="CLUSTER.json", help="cluster description (gpu, nodes, gpus_per_node, …)")
    command.add_argument("--gpu", help=f"GPU type: {', '.join(GPU_TYPES)}")
    command.add_argument("--nodes", type=int, help="nodes in the cluster")
    command.add_argument("--gpus-per-node", type=int, help="GPUs per node")


def read_json(path: str, field: str) -> object:
    try:
        return json.loads(Path(path).read_text())
    except OSError as error:
        raise ConfigError({field: f"cannot read {path}: {error.strerror}"}) from None
    except json.JSONDecodeError as error:
        raise ConfigError({field: f"{path} is not JSON: {error}"}) from None


def cluster_of(arguments: argparse.Namespace) -> dict:
    cluster = read_json(arguments.cluster, "cluster") if arguments.cluster else {}
    if not isinstance(cluster, dict):
        raise ConfigError({"cluster": "must be a JSON object"})
    flags = {"gpu": arguments.gpu, "nodes": arguments.nodes, "gpus_per_node": arguments.gpus_per_node}
    return {**cluster, **{name: value for name, value in flags.items() if value is not None}}


def model_of(argument: str) -> object:
    if argument in MODEL_PRESETS:
        return {"preset": argument}
    if not Path(argument).exists():
        raise ConfigError(
            {"model": f"{argument!r} is neither a preset ({', '.join(MODEL_PRESETS)}) nor a model file (MODEL.json)"}
        )
    document = read_json(argument, "model")
    if isinstance(document, dict) and isinstance(document.get("model"), dict):
        return document["model"]
    return document


# ---- estimate ----


def run_estimate(arguments: argparse.Namespace) -> str:
    document = read_json(arguments.config, "config")
    return estimate_text(document, cluster_of(arguments), arguments.runtime, arguments.json)


def estimate_text(document: object, cluster: dict, runtime: str = "loom", as_json: bool = False) -> str:
    """The estimate of a run-config document on a cluster, as a report or as JSON (also `loom plan estimate`)."""
    result, defaults = planned_estimate(document, cluster, timeline=False, runtime=runtime)
    if as_json:
        return json.dumps({**result.to_json(timeline=False), "defaults": defaults}, indent=2)
    return describe_estimate(result, defaults)


def defaults_line(defaults: dict) -> str:
    if not defaults:
        return "Planning defaults: none (CONFIG.json sets every field they cover)"
    taken = ", ".join(f"{path} = {value}" for path, value in defaults.items())
    return f"Planning defaults for what CONFIG.json leaves out: {taken}"


def describe_estimate(result: Estimate, defaults: dict) -> str:
    layout, cluster = result.layout, result.cluster
    parallel = layout.parallel
    header = (
        f"{parallel.world_size} of {cluster.world_size} × {cluster.gpu} ({cluster.nodes} node(s) × "
        f"{cluster.gpus_per_node}); tp {parallel.tp}, cp {parallel.cp}, pp {parallel.pp} "
        f"({parallel.pp_schedule if parallel.pp > 1 else 'no pipeline'}), dp_replicate "
        f"{parallel.dp_replicate} × dp_shard {parallel.dp_shard}, ZeRO-{parallel.zero}, recompute "
        f"{layout.config.compute.recompute}, {layout.precision}; {layout.global_batch} sequences × "
        f"{layout.model.seq_len} tokens a step"
    )
    if layout.accumulation_steps > 1:
        header += f" in {layout.accumulation_steps} accumulation steps of {layout.config.sequences_per_pass} sequences"
    return "\n\n".join(
        [
            header + "\n" + defaults_line(defaults),
            memory_table(result),
            time_table(result),
            throughput_lines(result),
            comm_table(result),
            warning_lines(result),
        ]
    )


def memory_table(result: Estimate) -> str:
    """Memory terms per pipeline rank in GiB (with many ranks: the first, the fullest and the last)."""
    ranks = result.memory
    if len(ranks) > MAX_RANK_COLUMNS:
        shown = sorted({0, result.peak.pp_rank, len(ranks) - 1})
        ranks = [ranks[index] for index in shown]
    names = list(dict.fromkeys(term.name for rank in ranks for term in rank.terms))
    rows = [
        [name] + [gib(next((t.value for t in rank.terms if t.name == name), None)) for rank in ranks] for name in names
    ]
    rows.append(["allocated"] + [gib(rank.allocated_bytes) for rank in ranks])
    rows.append(["reserved (allocator fragmentation)"] + [gib(rank.reserved_bytes) for rank in ranks])
    capacity = result.cluster.gpu_type.memory_bytes
    verdict = "fits" if result.fits else f"does NOT fit (pipeline rank {result.peak.pp_rank})"
    title = (
        f"Memory per GPU, GiB — usable {gib(result.usable_bytes)} of {gib(capacity)}, "
        f"headroom {gib(result.headroom_bytes)}: {verdict}"
    )
    outside = "\n".join(f"  {term.name}: {gib(term.value)} GiB ({term.formula})" for term in result.outside_allocator)
    return (
        title
        + "\n"
        + table(["term"] + [f"pp rank {rank.pp_rank}" for rank in ranks], rows)
        + "\nOutside the allocator, per GPU\n"
        + outside
    )


def time_table(result: Estimate) -> str:
    rows = [[term.name, f"{term.value:,.3f}"] for term in result.time_terms]
    rows.append(["step", f"{result.step_s:,.3f}"])
    return "Step time\n" + table(["part", "seconds"], rows)


def throughput_lines(result: Estimate) -> str:
    return (
        f"Throughput: {result.tokens_per_s:,.0f} tokens/s, MFU {result.mfu:.1%}, "
        f"pipeline bubble {result.bubble_fraction:.1%} of compute"
    )


def comm_table(result: Estimate) -> str:
    rows = [
        [kind, f"{entry['sent_bytes'] / GIB:,.2f}", f"{entry['time_s']:,.3f}", f"{entry['exposed_s']:,.3f}"]
        for kind, entry in result.comm_by_kind().items()
    ]
    if not rows:
        return "Communication: none"
    header = ["kind", "sent GiB", "time s", "exposed s"]
    return "Communication per kind (busiest pipeline rank)\n" + table(header, rows)


def warning_lines(result: Estimate) -> str:
    if not result.warnings:
        return "Warnings: none"
    return "Warnings\n" + "\n".join(f"  {item['field']}: {item['message']}" for item in result.warnings)


# ---- search ----


def run_search(arguments: argparse.Namespace) -> str:
    result = search(
        model_of(arguments.model),
        cluster_of(arguments),
        arguments.global_batch,
        seq_len=arguments.seq_len,
        precision=arguments.precision,
        limit=arguments.limit,
        runnable_only=arguments.runnable_only,
    )
    if arguments.json:
        return json.dumps(result.to_json(), indent=2)
    return describe_search(result)


def describe_search(result: SearchResult) -> str:
    counts = (
        f"{result.evaluated:,} layouts evaluated, {result.valid:,} valid, {result.fitting:,} fit, "
        f"{result.timed:,} timed exactly, in {result.seconds:.2f} s"
    )
    if result.message:
        return f"{counts}\n{result.message}"
    places = {id(found): place for place, found in enumerate(result.results, start=1)}
    fastest = [search_row(str(place), found) for place, found in enumerate(result.results, start=1)]
    front = [search_row(str(places.get(id(found), "")), found) for found in result.pareto]
    return "\n\n".join(
        [
            counts,
            "Fastest layouts that fit\n" + table(SEARCH_COLUMNS, fastest),
            "Pareto frontier: less memory costs speed\n" + table(SEARCH_COLUMNS, front),
            "runnable: whether loom's trainer runs the layout today (some it only plans: expert parallelism across "
            "replicas with an ep that does not divide dp_shard × cp, optimizer offload, expert capacity under cp)",
        ]
    )


SEARCH_COLUMNS = ["rank", "layout", "tokens/s", "MFU", "step s", "peak GiB", "bubble", "runnable"]


def search_row(rank: str, found: Found) -> list[str]:
    return [
        rank,
        found.summary,
        f"{found.tokens_per_s:,.0f}",
        f"{found.mfu:.1%}",
        f"{found.step_s:.3f}",
        f"{found.peak_bytes / GIB:.1f}",
        f"{found.bubble_fraction:.1%}",
        "yes" if found.runnable else "no",
    ]


# ---- export ----


def run_export(arguments: argparse.Namespace) -> str:
    return export_text(read_json(arguments.config, "config"), arguments.format)


def export_text(document: object, format: str) -> str:
    """The job alone; the planning defaults taken and the warnings go to stderr (also `loom plan export`)."""
    document, defaults = with_planning_defaults(document)
    config = parse_config(with_preset(document) if isinstance(document, dict) else document, runnable=False)
    job = export_job(config, format)
    if defaults:
        print(defaults_line(defaults), file=sys.stderr)
    for warning in job["warnings"]:
        print(f"warning: {warning['field']}: {warning['message']}", file=sys.stderr)
    return job["text"].rstrip("\n")


# ---- text tables ----


def gib(value: float | None) -> str:
    return "" if value is None else f"{value / GIB:,.2f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    """Columns of numbers right-aligned, the others left-aligned."""
    columns = range(len(header))
    widths = [max(len(row[column]) for row in [header, *rows]) for column in columns]
    numeric = [all(is_number(row[column]) for row in rows) for column in columns]

    def line(cells: list[str]) -> str:
        return (
            "  "
            + "  ".join(
                cell.rjust(widths[column]) if numeric[column] else cell.ljust(widths[column])
                for column, cell in enumerate(cells)
            ).rstrip()
        )

    return "\n".join(line(row) for row in [header, *rows])


def is_number(cell: str) -> bool:
    """ "1,234.5", "37.5%", "" (a term a rank does not have)."""
    return not cell or cell.replace(",", "").replace(".", "", 1).rstrip("%").isdigit()


if __name__ == "__main__":
    sys.exit(main())
