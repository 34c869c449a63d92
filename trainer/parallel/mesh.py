"""The one object that owns the device mesh and knows each rank's place in it."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.config import ParallelConfig

# Outermost first: tp ranks are neighbours (same node, fastest links), then cp, dp_shard,
# dp_replicate, and pipeline stages are furthest apart.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class ParallelMesh:
    """Validates the degrees against the launch, builds the DeviceMesh, and hands out submeshes.

    Derived dims: "dp" (dp_replicate × dp_shard: ranks that see different data) and "dp_shard_cp"
    (the ranks FSDP shards over: context-parallel ranks hold the same parameters, so they shard too).
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

    def __getitem__(self, dims: str | tuple[str, ...]) -> DeviceMesh:
        return self.mesh[dims]

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
