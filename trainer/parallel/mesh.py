"""The one object that owns the device mesh and knows each rank's place in it."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.config import ParallelConfig

# Outermost first: tp ranks are neighbours (same node, fastest links), then cp, dp_shard,
# dp_replicate, and pipeline stages are furthest apart.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT_DIMS = ("expert_replicate", "expert_shard", "ep")


class ParallelMesh:
    """Validates the degrees against the launch, builds the DeviceMesh, and hands out submeshes.

    Derived dims: "dp" (dp_replicate × dp_shard: ranks that see different data), "dp_shard_cp"
    (the ranks FSDP shards over: context-parallel ranks hold the same parameters, so they shard too),
    "dp_cp" (every rank that sees different tokens) and "cp_tp" (the ranks that hold parts of the same sequences
    in a mixture of experts' router).

    With expert parallelism, `experts` is the same dp_replicate × dp_shard × cp ranks as dims of their own,
    "expert_replicate" (dp_replicate), "expert_shard" and "ep", whose ranks hold different experts, beside "tp",
    which splits each expert's columns; the ranks of expert_replicate × expert_shard hold the same ones, which FSDP
    shards over expert_shard.
    """

    def __init__(self, parallel: ParallelConfig, world_size: int, device_type: str):
        if parallel.world_size != world_size:
            raise ValueError(
                f"the layout needs {parallel.world_size} ranks "
                f"(pp × dp_replicate × dp_shard × cp × tp) but {world_size} were launched"
            )
        self.parallel = parallel
        shape = tuple(getattr(parallel, dim) for dim in MESH_DIMS)
        self.mesh: DeviceMesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        self.mesh["dp_replicate", "dp_shard"]._flatten("dp")
        self.mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        self.mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        self.mesh["cp", "tp"]._flatten("cp_tp")
        self.experts: DeviceMesh | None = None
        if parallel.ep > 1:
            self.experts = self.mesh["dp_cp", "tp"]._unflatten(
                0,
                (parallel.dp_replicate, parallel.sharding_ranks // parallel.ep, parallel.ep),
                EXPERT_DIMS,
            )

    def __getitem__(self, dims: str | tuple[str, ...]) -> DeviceMesh:
        return self.mesh[dims]

    def dim_mesh(self, dim: str) -> DeviceMesh | None:
        """The 1-D mesh of a dim, derived ones included, or of the experts mesh (None without expert parallelism)."""
        if dim in EXPERT_DIMS:
            return self.experts[dim] if self.experts is not None else None
        return self.mesh[dim]

    def rank_in(self, dim: str) -> int:
        return self.mesh[dim].get_local_rank()

    @property
    def dp_rank(self) -> int:
        return self.rank_in("dp")

    @property
    def pp_rank(self) -> int:
        return self.rank_in("pp")

    @property
    def is_first_stage_rank(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage_rank(self) -> bool:
        return self.pp_rank == self.parallel.pp - 1

    def coordinates(self) -> dict[str, int]:
        """This rank's place on every dim, e.g. {"pp": 1, "dp_replicate": 0, …}."""
        return {dim: self.rank_in(dim) for dim in MESH_DIMS}
