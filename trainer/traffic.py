"""Who sends how many bytes to whom: recorded collectives turned into one rank's row of the
rank × rank traffic matrix, and rows assembled into the matrix.

Pure Python, no torch, so the platform can import it to build heatmaps from `comm` events.

Bytes follow the ring algorithms (what NCCL and gloo run for large buffers), in each group's rank
order: rank i of a group sends to rank i+1 (its successor), the last one to the first.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# The mesh dims whose groups name a kind of traffic, first match wins where two dims hold the
# same ranks (tp 2 × dp 1 makes "tp" and the whole world alike). The derived dims count as dp:
# "dp" is dp_replicate × dp_shard, "dp_shard_cp" is where FSDP shards when cp > 1, and
# "expert_shard" where it shards experts beyond expert parallelism. Expert parallelism's ranks are
# some of those: its group names an all-to-all first (group_kind), any other collective only where
# no other dim holds the same ranks.
KIND_OF_MESH_DIM = {
    "tp": "tp",
    "cp": "cp",
    "pp": "pp",
    "dp_shard": "dp",
    "dp_replicate": "dp",
    "dp": "dp",
    "dp_shard_cp": "dp",
    "expert_shard": "dp",
    "ep": "ep",
}
WORLD = "world"
OTHER = "other"

OPS = frozenset(
    {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "broadcast",
        "reduce",
        "gather",
        "scatter",
        "send",
        "recv",
        "barrier",
    }
)


@dataclass(frozen=True)
class CommOp:
    """One collective or point-to-point op as this rank issued it.

    nbytes is the whole buffer the op works on: the reduced buffer (all_reduce, reduce,
    broadcast), the gathered output (all_gather), the input before scattering (reduce_scatter),
    this rank's input (all_to_all, gather), one rank's chunk (scatter), the tensor (send, recv).
    peer_bytes, for an all_to_all with uneven splits, is what this rank sends each rank of the group.
    peer is a global rank: send's destination, recv's source, or the root of a rooted collective.
    """

    op: str
    group: tuple[int, ...]
    nbytes: int
    peer: int | None = None
    peer_bytes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}; expected one of {sorted(OPS)}")


def bytes_sent(op: CommOp, rank: int) -> list[tuple[int, int]]:
    """(peer, bytes) for every peer `rank` sends to while taking part in `op`."""
    size = len(op.group)
    if size < 2 or rank not in op.group:
        return []
    successor = op.group[(op.group.index(rank) + 1) % size]
    others = [peer for peer in op.group if peer != rank]
    match op.op:
        case "all_reduce":
            # Reduce-scatter then all-gather: 2(n−1) steps of one n-th of the buffer each.
            return [(successor, 2 * (size - 1) * op.nbytes // size)]
        case "all_gather" | "reduce_scatter":
            return [(successor, (size - 1) * op.nbytes // size)]
        case "all_to_all" if op.peer_bytes is not None:
            return [(peer, nbytes) for peer, nbytes in zip(op.group, op.peer_bytes, strict=True) if peer != rank]
        case "all_to_all":
            return [(peer, op.nbytes // size) for peer in others]
        case "broadcast":
            # The buffer travels the ring from the root; the root's predecessor is its last stop.
            return [] if successor == op.peer else [(successor, op.nbytes)]
        case "reduce":
            # The partial sums travel the ring and end at the root.
            return [] if rank == op.peer else [(successor, op.nbytes)]
        case "gather":
            return [] if rank == op.peer else [(op.peer, op.nbytes)]
        case "scatter":
            return [(peer, op.nbytes) for peer in others] if rank == op.peer else []
        case "send":
            return [(op.peer, op.nbytes)]
        case _:
            return []


def group_kind(
    group: Iterable[int], mesh_groups: Mapping[str, Iterable[int]], world_size: int, op: str | None = None
) -> str:
    """The kind of traffic a group carries: the kind of the first mesh dim (in KIND_OF_MESH_DIM
    order) whose group holds the same ranks, else of the first whose group holds them all (a group of
    some of a dim's ranks: the first and the last pipeline rank summing a tied embedding's gradients),
    else "world" for all ranks, else "other". An all-to-all on the expert-parallel group is expert
    traffic whatever other dim holds its ranks too."""
    ranks = frozenset(group)
    if op == "all_to_all" and "ep" in mesh_groups and frozenset(mesh_groups["ep"]) == ranks:
        return "ep"
    for holds in (ranks.__eq__, ranks.issubset):
        for dim, kind in KIND_OF_MESH_DIM.items():
            if dim in mesh_groups and holds(frozenset(mesh_groups[dim])):
                return kind
    return WORLD if len(ranks) == world_size else OTHER


@dataclass
class _Route:
    nbytes: int = 0
    ops: int = 0


class TrafficRow:
    """One rank's traffic over a window of steps, summed per (destination, kind)."""

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        self._routes: dict[tuple[int, str], _Route] = defaultdict(_Route)
        self._op_counts: Counter[str] = Counter()

    def add(self, op: CommOp, kind: str) -> None:
        self._op_counts[op.op] += 1
        for peer, nbytes in bytes_sent(op, self.rank):
            route = self._routes[peer, kind]
            route.nbytes += nbytes
            route.ops += 1

    def payload(self, first_step: int, last_step: int, time_s: float) -> dict:
        """The `comm` event payload: sends is [[dst_rank, bytes, kind, ops], …] by dst then kind."""
        return {
            "rank": self.rank,
            "window": [first_step, last_step],
            "world_size": self.world_size,
            "sends": [[peer, route.nbytes, kind, route.ops] for (peer, kind), route in sorted(self._routes.items())],
            "ops": dict(sorted(self._op_counts.items())),
            "time_s": time_s,
        }


@dataclass(frozen=True)
class TrafficMatrix:
    """bytes[src][dst]: what src sent to dst; by_kind holds the same split by traffic kind."""

    world_size: int
    bytes: list[list[int]]
    by_kind: dict[str, list[list[int]]]


def traffic_matrix(rows: Iterable[Mapping]) -> TrafficMatrix:
    """Sum `comm` payloads (each with its "rank") into the rank × rank matrix; rows of several
    windows add up, and a rank without a row sent nothing."""
    rows = list(rows)
    sizes = {row["world_size"] for row in rows}
    if len(sizes) > 1:
        raise ValueError(f"rows disagree on the world size: {sorted(sizes)}; assemble one attempt at a time")
    world_size = sizes.pop() if sizes else 0

    def zeros() -> list[list[int]]:
        return [[0] * world_size for _ in range(world_size)]

    total = zeros()
    by_kind: dict[str, list[list[int]]] = defaultdict(zeros)
    for row in rows:
        source = row["rank"]
        for destination, nbytes, kind, _ops in row["sends"]:
            if not (0 <= source < world_size and 0 <= destination < world_size):
                raise ValueError(f"rank {source} → {destination} is outside a world of {world_size} ranks")
            total[source][destination] += nbytes
            by_kind[kind][source][destination] += nbytes
    return TrafficMatrix(world_size, total, dict(by_kind))
