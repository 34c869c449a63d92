"""What a new run may ask for: a world that fits the launch backend, a model of bounded size, and a fair share per
user of the ranks in use and of the queue. Refusals are field-level errors, keyed like the run API's.

The capacity is what the backend reports now: the local backend's GPUs (or its CPU slots, LOOM_LOCAL_CPU_SLOTS,
when its ranks train on CPU); a cluster's usable nodes, less the excluded ones, × LOOM_RANKS_PER_NODE. Nodes that
are busy count: a run that fits waits for them; one that never fits is refused now, not left queued forever."""

import logging
import math
from dataclasses import dataclass

from django.conf import settings

from trainer.config import ParallelConfig, RunConfig
from trainer.plan.parameters import total_parameters

from . import states
from .backends import Backend, current_backend
from .models import Run
from .nodes import excluded_names

log = logging.getLogger(__name__)

# The degrees whose product is the world size, in the order a tie names them.
DEGREE_FIELDS = ("dp_replicate", "dp_shard", "tp", "pp", "cp")


def launch_limit_errors(config: dict, backend: Backend | None = None) -> dict[str, str]:
    """What in a validated config exceeds the backend's capacity or the model-size bound, keyed by field."""
    run_config = RunConfig.model_validate(config)
    errors: dict[str, str] = {}
    world_size = run_config.parallel.world_size
    capacity = rank_capacity(backend or current_backend())
    if capacity is not None and world_size > capacity.ranks:
        errors[f"config.parallel.{largest_degree(run_config.parallel)}"] = (
            f"the layout needs {world_size} ranks but the {capacity.backend} backend has room for {capacity.ranks} "
            f"({capacity.what}); choose degrees whose product is at most {capacity.ranks}"
        )
    parameters = total_parameters(run_config.model)
    if parameters > settings.LOOM_MAX_MODEL_PARAMETERS:
        errors["config.model"] = (
            f"the model has {parameters:,} parameters, more than this platform trains "
            f"({settings.LOOM_MAX_MODEL_PARAMETERS:,}, LOOM_MAX_MODEL_PARAMETERS); use fewer layers or a smaller dim"
        )
    return errors


def owner_limit_errors(owner, config: dict) -> dict[str, str]:
    """The owner's share: queued runs and ranks of active runs, this one included. Call under a lock on the
    owner's row, so two runs created at once are counted one after the other."""
    active = list(Run.objects.filter(owner=owner, state__in=states.ACTIVE).values_list("state", "config__parallel"))
    queued = sum(1 for state, _ in active if state == states.QUEUED)
    if queued >= settings.LOOM_USER_MAX_QUEUED:
        return {
            "run": f"you have {queued} queued runs, the most one user may have waiting "
            f"(LOOM_USER_MAX_QUEUED); cancel one or wait until one starts"
        }
    # Stored configs are validated with every default filled in: their degrees are read, not validated again.
    in_use = sum(math.prod(degrees.get(name, 1) for name in DEGREE_FIELDS) for _, degrees in active)
    parallel = RunConfig.model_validate(config).parallel
    if in_use + parallel.world_size > settings.LOOM_USER_MAX_RANKS:
        return {
            f"config.parallel.{largest_degree(parallel)}": (
                f"your active runs hold {in_use} ranks and this one needs {parallel.world_size}, more than the "
                f"{settings.LOOM_USER_MAX_RANKS} one user may use at once (LOOM_USER_MAX_RANKS); use fewer ranks "
                f"or wait until a run ends"
            )
        }
    return {}


@dataclass(frozen=True)
class Capacity:
    backend: str
    ranks: int
    what: str  # where the ranks come from, for the refusal's message


def rank_capacity(backend: Backend) -> Capacity | None:
    """How many ranks the backend can run one attempt on; None when it cannot say now (the scheduler then
    decides at launch)."""
    try:
        nodes = backend.nodes()
    # Whatever keeps the backend from answering (slurmctld down, sinfo missing) must not keep runs from being
    # created: the scheduler still refuses at launch what can never run.
    except Exception as error:
        log.warning("the %s backend could not report its nodes; launch capacity not checked: %s", backend.name, error)
        return None
    if not getattr(backend, "spans_nodes", False):
        gpus = sum(node.gpus for node in nodes)
        if gpus:
            return Capacity(backend.name, gpus, f"{gpus} GPUs on this host")
        slots = settings.LOOM_LOCAL_CPU_SLOTS
        return Capacity(backend.name, slots, f"{slots} CPU rank slots, LOOM_LOCAL_CPU_SLOTS")
    excluded = set(excluded_names(backend))
    usable = [node for node in nodes if node.usable and node.name not in excluded]
    per_node = settings.LOOM_RANKS_PER_NODE
    return Capacity(
        backend.name, len(usable) * per_node, f"{len(usable)} usable nodes × {per_node} ranks, LOOM_RANKS_PER_NODE"
    )


def largest_degree(parallel: ParallelConfig) -> str:
    """The degree a user would lower first to shrink the world: the largest."""
    return max(DEGREE_FIELDS, key=lambda name: (getattr(parallel, name), -DEGREE_FIELDS.index(name)))
