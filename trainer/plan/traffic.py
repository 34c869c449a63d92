"""The predicted rank × rank traffic matrix of one training step, in the same shape as the one the
trainer measures (trainer/traffic.py): every rank's collectives from the communication model, placed
on the layout's groups (tp innermost, then cp, dp_shard, dp_replicate, pp) and turned into bytes per
destination by the same ring rules the recorder uses."""

from __future__ import annotations

import itertools

from trainer.config import ParallelConfig, RunConfig
from trainer.plan.communication import step_traffic
from trainer.plan.hardware import ClusterSpec
from trainer.plan.layout import PLACEMENT, Layout
from trainer.plan.memory import expert_elements, rank_coordinates, state_elements
from trainer.plan.parameters import rank_holding, stages_of_rank
from trainer.traffic import CommOp, TrafficMatrix, TrafficRow, traffic_matrix

MAX_RANKS = 1024
# The mesh dims each group of trainer.plan.communication.groups() spans.
GROUP_DIMS = {
    "tp": ("tp",),
    "cp": ("cp",),
    "dp_shard": ("dp_shard", "cp"),
    "dp_replicate": ("dp_replicate",),
    "dp": ("dp_replicate", "dp_shard"),
    "pp": ("pp",),
}


def global_rank(parallel: ParallelConfig, coordinates: dict[str, int]) -> int:
    rank = 0
    for dim in reversed(PLACEMENT):
        rank = rank * getattr(parallel, dim) + coordinates[dim]
    return rank


def group_members(parallel: ParallelConfig, rank: int, dims: tuple[str, ...]) -> tuple[int, ...]:
    """The ranks that share every coordinate with `rank` except `dims`, in rank order (which is the
    order of the trainer's mesh groups)."""
    where = rank_coordinates(parallel, rank)
    ranges = [range(getattr(parallel, dim)) for dim in dims]
    members = [
        global_rank(parallel, where | dict(zip(dims, values, strict=True))) for values in itertools.product(*ranges)
    ]
    return tuple(sorted(members))


def expert_group_members(parallel: ParallelConfig, rank: int, dim: str) -> tuple[int, ...]:
    """The trainer's experts mesh cuts dp_shard × cp (cp innermost) into runs of ep ranks: "ep" is the run
    holding this rank (one copy of the experts between them), "expert_shard" every ep-th rank from this one's
    place in its run (the ranks holding the same experts)."""
    where = rank_coordinates(parallel, rank)
    sharding_index = where["dp_shard"] * parallel.cp + where["cp"]
    if dim == "ep":
        first = sharding_index - sharding_index % parallel.ep
        indices = range(first, first + parallel.ep)
    else:
        indices = range(sharding_index % parallel.ep, parallel.sharding_ranks, parallel.ep)
    members = [
        global_rank(parallel, where | {"dp_shard": index // parallel.cp, "cp": index % parallel.cp})
        for index in indices
    ]
    return tuple(sorted(members))


def pipeline_sends(layout: Layout, rank: int, message_bytes: float) -> list[CommOp]:
    """Each held stage sends its activations to the next stage's rank and its input gradients to
    the previous stage's rank, once per microbatch."""
    parallel = layout.parallel
    where = rank_coordinates(parallel, rank)
    holder = {stage: pp_rank for pp_rank in range(parallel.pp) for stage in stages_of_rank(parallel, pp_rank)}
    sends = []
    for stage in stages_of_rank(parallel, where["pp"]):
        for neighbour in (stage + 1, stage - 1):
            if 0 <= neighbour < layout.total_stages and holder[neighbour] != where["pp"]:
                peer = global_rank(parallel, where | {"pp": holder[neighbour]})
                group = group_members(parallel, rank, ("pp",))
                sends.append(CommOp("send", group, round(message_bytes * layout.microbatches), peer))
    return sends


def pipeline_ends(parallel: ParallelConfig, rank: int) -> tuple[int, int]:
    """The first and the last pipeline rank at `rank`'s other coordinates: the two that sum a tied embedding's
    gradients (trainer/parallel/tied.py)."""
    where = rank_coordinates(parallel, rank)
    return global_rank(parallel, where | {"pp": 0}), global_rank(parallel, where | {"pp": parallel.pp - 1})


DEFAULT_GPUS_PER_NODE = ClusterSpec.model_fields["gpus_per_node"].default


def predicted_rows(config: RunConfig, cluster: ClusterSpec | None = None) -> list[dict]:
    """One `comm` payload per rank for one step, as the trainer's recorder would send it."""
    layout, parallel = Layout(config), config.parallel
    world = parallel.world_size
    if world > MAX_RANKS:
        raise ValueError(f"the predicted matrix covers up to {MAX_RANKS} ranks; this layout has {world}")
    # Bytes do not depend on the cluster; without one, nodes of the default size hold the ranks.
    cluster = cluster or ClusterSpec(nodes=-(-world // DEFAULT_GPUS_PER_NODE))
    by_pp_rank = {}
    for pp_rank in range(parallel.pp):
        held = rank_holding(layout.model, parallel, pp_rank)
        elements = state_elements(layout, held.tensors).unsharded
        by_pp_rank[pp_rank] = step_traffic(
            layout,
            cluster,
            elements,
            held.kinds,
            held.holds_embedding,
            held.holds_output,
            expert_elements(layout, held.tensors),
        )
    rows = []
    for rank in range(world):
        row = TrafficRow(rank, world)
        for item in by_pp_rank[rank_coordinates(parallel, rank)["pp"]]:
            if item.kind == "pp" and item.op == "send":
                for op in pipeline_sends(layout, rank, item.buffer_bytes):
                    row.add(op, "pp")
                continue
            if item.kind == "pp":
                group = pipeline_ends(parallel, rank)
            elif item.dim in ("ep", "expert_shard"):
                group = expert_group_members(parallel, rank, item.dim)
            else:
                group = group_members(parallel, rank, GROUP_DIMS[item.dim])
            row.add(CommOp(item.op, group, round(item.buffer_bytes * item.calls)), item.kind)
        rows.append(row.payload(1, 1, 0.0))
    return rows


def predicted_matrix(config: RunConfig, cluster: ClusterSpec | None = None) -> TrafficMatrix:
    return traffic_matrix(predicted_rows(config, cluster))
