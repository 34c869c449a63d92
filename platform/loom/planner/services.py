"""Planner rules: what a layout costs before a GPU is touched, which layouts to try, what traffic it
makes, and how to hand it to another trainer. The arithmetic is the trainer's own estimator
(trainer.plan); this module validates what users send and shapes the answers.

Every function raises ConfigError whose `errors` are keyed by the field to change: run-config paths
("parallel.tp"), cluster fields ("cluster.gpu") or the request's own fields ("global_batch")."""

from trainer.config import PIPELINE_SCHEDULES, ConfigError, RunConfig, parse_config
from trainer.plan.defaults import planned_estimate, with_planning_defaults
from trainer.plan.estimate import estimate, parse_plan
from trainer.plan.estimate import estimate_layout as estimate_layout_for
from trainer.plan.export import EXPORTERS, export_job
from trainer.plan.hardware import GPU_TYPES, ClusterSpec
from trainer.plan.layout import Layout
from trainer.plan.presets import MODEL_PRESETS, preset_model, with_preset
from trainer.plan.search import search
from trainer.plan.traffic import predicted_matrix

TERA = 1e12
SEARCH_LIMIT_MAX = 100
# What a run keeps of its estimate: the headline numbers and where they came from, not the
# per-op communication breakdown or the per-rank memory terms the designer draws.
STORED_MEMORY_KEYS = (
    "capacity_bytes",
    "usable_bytes",
    "peak_bytes",
    "headroom_bytes",
    "peak_allocated_bytes",
    "peak_pp_rank",
    "fits",
)


def catalog() -> dict:
    """What the designer offers: model presets (every model field, defaults filled in, so choosing
    one replaces the whole model section), GPU types and pipeline schedules."""
    return {
        "presets": [{"name": name, "model": preset_model(name).model_dump(mode="json")} for name in MODEL_PRESETS],
        "gpus": [
            {
                "name": gpu.name,
                "memory_bytes": gpu.memory_bytes,
                "memory_bandwidth": gpu.memory_bandwidth,
                "peak_bf16_tflops": gpu.peak_bf16_flops / TERA,
                "peak_fp8_tflops": gpu.peak_fp8_flops / TERA if gpu.peak_fp8_flops else None,
            }
            for gpu in GPU_TYPES.values()
        ],
        "schedules": list(PIPELINE_SCHEDULES),
        "cluster": ClusterSpec().model_dump(mode="json"),
    }


def estimate_layout(document, cluster) -> dict:
    """The full estimate the designer draws, schedule timeline included, with the planning defaults
    (trainer.plan.defaults) the document took where it left fields out."""
    result, defaults = planned_estimate(document, cluster)
    return {**result.to_json(), "defaults": defaults}


def estimate_for_run(config: dict, cluster) -> dict:
    """The part of a validated run config's estimate that is stored with the run, so its page can
    set what was predicted beside what it measures."""
    result = estimate(config, cluster, timeline=False)
    full = result.to_json(timeline=False)
    return {
        "cluster": full["cluster"],
        "layout": full["layout"],
        # The trainer reports tokens/s per rank; data-parallel ranks see different tokens.
        "data_parallel": result.layout.parallel.data_parallel,
        "memory": {key: full["memory"][key] for key in STORED_MEMORY_KEYS},
        "time": full["time"],
        "tokens_per_s": full["tokens_per_s"],
        "mfu": full["mfu"],
        "bubble_fraction": full["bubble_fraction"],
        "warnings": full["warnings"],
    }


def search_layouts(model, cluster, global_batch, seq_len=None, precision="bf16", limit=20, runnable_only=False) -> dict:
    """The fastest layouts for a model on a cluster at a global batch, ranked, with their Pareto front;
    with runnable_only, only layouts loom's trainer runs today."""
    if is_count(limit) and limit > SEARCH_LIMIT_MAX:
        raise ConfigError({"limit": f"must be at most {SEARCH_LIMIT_MAX} layouts"})
    found = search(
        model, cluster, global_batch, seq_len=seq_len, precision=precision, limit=limit, runnable_only=runnable_only
    )
    return found.to_json()


def predicted_traffic(document, cluster) -> dict:
    """Bytes each rank sends each other rank in one step, in total and per kind (tp, cp, dp, pp, …)."""
    config, cluster_spec = parse_plan(with_planning_defaults(document, cluster)[0], cluster)
    try:
        matrix = predicted_matrix(config, cluster_spec)
    except ValueError as error:
        raise ConfigError({"parallel": str(error)}) from None
    return {"world_size": matrix.world_size, "bytes": matrix.bytes, "by_kind": matrix.by_kind}


def export_layout(document, export_format, cluster=None) -> dict:
    """The layout as another trainer's configuration (a torchtitan TOML file or Megatron-LM arguments),
    with warnings about what it carries over as is; with a cluster, the layout's step time and peak memory
    priced for that trainer (which fuses, overlaps, recomputes and keeps otherwise than loom's) beside loom's."""
    errors = {} if export_format in EXPORTERS else {"format": f"must be one of {list(EXPORTERS)}"}
    config = None
    completed, defaults = with_planning_defaults(document)
    try:
        config = parse_layout(completed)
    except ConfigError as error:
        errors |= error.errors
    try:
        cluster_spec = parse_plan({}, cluster)[1] if cluster is not None else None
    except ConfigError as error:
        errors |= error.errors
    if errors:
        raise ConfigError(errors)
    answer = {**export_job(config, export_format), "defaults": defaults}
    if cluster_spec is not None:
        answer["estimates"] = {
            runtime: runtime_estimate(config, cluster_spec, runtime) for runtime in ("loom", export_format)
        }
    return answer


def runtime_estimate(config: RunConfig, cluster: ClusterSpec, runtime: str) -> dict:
    result = estimate_layout_for(Layout(config, runtime), cluster, timeline=False)
    return {
        "runtime": runtime,
        "step_s": result.step_s,
        "tokens_per_s": result.tokens_per_s,
        "peak_bytes": result.peak.reserved_bytes,
        "fits": result.fits,
    }


def parse_layout(document) -> RunConfig:
    """A run config as the planner takes it: a model preset allowed, layouts the trainer cannot run yet too."""
    return parse_config(with_preset(document) if isinstance(document, dict) else document, runnable=False)


def is_count(value) -> bool:
    # bool is an int to Python, not a count to a user.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
