"""Data parallelism over the "dp" dims, as ParallelConfig.data_parallel_path picks it: FSDP2 (HSDP with
replicas) or DDP."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from trainer.config import ParallelConfig
from trainer.model import Transformer

from .expert import shard_experts
from .mesh import ParallelMesh


def apply_fsdp(model: Transformer, mesh: ParallelMesh, parallel: ParallelConfig, param_dtype: torch.dtype) -> None:
    """fully_shard each block, then the root: parameters live sharded and are gathered per block.
    With dp_replicate > 1 the mesh is 2-D and FSDP2 does HSDP (shard within, all-reduce across); with
    dp_shard × cp = 1 each replica is one whole shard and HSDP is plain replication."""
    dims = ("dp_replicate", "dp_shard_cp") if parallel.dp_replicate > 1 else ("dp_shard_cp",)
    # Parameters may compute in bf16, but gradients are reduced and kept in fp32 (master weights).
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if mesh.experts is not None:
        shard_experts(model, mesh.experts, parallel, policy)
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh[dims], mp_policy=policy, reshard_after_forward=parallel.reshard_after_forward)
    fully_shard(model, mesh=mesh[dims], mp_policy=policy, reshard_after_forward=parallel.reshard_after_forward)


def apply_ddp(module: nn.Module, mesh: ParallelMesh, device: torch.device) -> nn.Module:
    """Replicas all-reduce gradients over the data-parallel group."""
    return DistributedDataParallel(
        module,
        process_group=mesh["dp"].get_group(),
        device_ids=[device.index] if device.type == "cuda" else None,
        # The only buffers are RoPE tables computed identically everywhere; re-syncing them is waste.
        forward_sync_buffers=False,
    )


@contextlib.contextmanager
def gradient_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """A forward and backward pass that reduces the data-parallel gradients (enabled) or only accumulates them
    locally, as the inner passes of gradient accumulation do: DDP's no_sync, or FSDP2 skipping its
    reduce-scatter (and HSDP its all-reduce) until the pass that enables it again."""
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(enabled)
    if isinstance(module, DistributedDataParallel) and not enabled:
        with module.no_sync():
            yield
    else:
        yield
