"""What the planner assumes where a run config is silent: one set for the command line, the API and
the designer's starting form, so the same document gets the same estimate from each.

The trainer's own defaults (trainer/config.py) suit its CPU demo: fp32 on CPU, no recompute, 8
sequences per rank, no sharding. A GPU layout planned from them is one nobody would run (Llama 3 8B
unsharded, every activation of 8 × 8,192-token sequences kept: over 300 GiB per GPU). Where a
document leaves a field out, the planner takes instead:

- `compute.precision` bf16 and `compute.recompute` selective;
- `data.micro_batch`: one sequence per pipeline microbatch (`parallel.microbatches`, 1 without a
  pipeline);
- `parallel.dp_shard`, when the document has no `parallel` section at all: every GPU of the cluster
  (FSDP over all of them). A document that gives any parallel field gets the trainer's defaults for
  the others, so a stated layout is never widened behind the user's back.

`planning_defaults` says which of these a document took, for the CLI to print and the API to return.
"""

from __future__ import annotations

from trainer.config import ConfigError
from trainer.plan.estimate import Estimate, estimate
from trainer.plan.hardware import ClusterSpec, parse_cluster
from trainer.plan.layout import Runtime

PLANNING_DEFAULTS = {"compute.precision": "bf16", "compute.recompute": "selective"}


def planning_defaults(document: object, cluster_document: object = None) -> dict[str, object]:
    """{field path: value} of the defaults above that `document` leaves out; nothing for what is not
    a JSON object (validation names it)."""
    if not isinstance(document, dict):
        return {}
    filled: dict[str, object] = {}
    for path, value in PLANNING_DEFAULTS.items():
        if is_missing(document, path):
            filled[path] = value
    parallel = document.get("parallel")
    if is_missing(document, "data.micro_batch"):
        microbatches = parallel.get("microbatches", 1) if isinstance(parallel, dict) else 1
        filled["data.micro_batch"] = microbatches if isinstance(microbatches, int) and microbatches >= 1 else 1
    if "parallel" not in document:
        filled["parallel.dp_shard"] = cluster_or_default(cluster_document).world_size
    return filled


def with_planning_defaults(document: object, cluster_document: object = None) -> tuple[object, dict[str, object]]:
    """`document` with the planning defaults it leaves out filled in, and those defaults."""
    filled = planning_defaults(document, cluster_document)
    if not filled:
        return document, filled
    completed = {name: dict(section) if isinstance(section, dict) else section for name, section in document.items()}
    for path, value in filled.items():
        section, field = path.split(".")
        completed.setdefault(section, {})[field] = value
    return completed, filled


def planned_estimate(
    document: object, cluster_document: object = None, *, timeline: bool = True, runtime: Runtime = "loom"
) -> tuple[Estimate, dict]:
    """The estimate of `document` with the planning defaults, and the defaults it took."""
    completed, filled = with_planning_defaults(document, cluster_document)
    return estimate(completed, cluster_document, timeline=timeline, runtime=runtime), filled


def is_missing(document: dict, path: str) -> bool:
    section, field = path.split(".")
    fields = document.get(section)
    return fields is None or (isinstance(fields, dict) and field not in fields)


def cluster_or_default(cluster_document: object) -> ClusterSpec:
    """The cluster, or the default one where it is invalid (its errors are reported with the estimate's)."""
    try:
        return parse_cluster(cluster_document)
    except ConfigError:
        return ClusterSpec()
