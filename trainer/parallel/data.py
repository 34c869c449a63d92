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
    """fully_shard each block, then the root: parameters live sharded between steps and are gathered per block.
    Every ZeRO stage runs on it: ZeRO-3 may free a block's parameters after its forward, ZeRO-1 and 2 hold them
    whole through the pass and differ in how often they reduce the gradients (accumulation_pass). With
    dp_replicate > 1 the mesh is 2-D and FSDP2 does HSDP (shard within, all-reduce across); with dp_shard × cp = 1
    each replica is one whole shard and HSDP is plain replication."""
    dims = ("dp_replicate", "dp_shard_cp") if parallel.dp_replicate > 1 else ("dp_shard_cp",)
    # Parameters may compute in bf16, but gradients are reduced and kept in fp32 (master weights).
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if mesh.experts is not None:
        shard_experts(model, mesh.experts, parallel, policy)
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh[dims], mp_policy=policy, reshard_after_forward=parallel.reshards_after_forward)
    fully_shard(model, mesh=mesh[dims], mp_policy=policy, reshard_after_forward=parallel.reshards_after_forward)


def apply_ddp(module: nn.Module, mesh: ParallelMesh, device: torch.device) -> nn.Module:
    """Replicas all-reduce gradients over the data-parallel group."""
    return DistributedDataParallel(
        module,
        process_group=mesh["dp"].get_group(),
        device_ids=[device.index] if device.type == "cuda" else None,
        # The only buffers are RoPE tables computed identically everywhere; re-syncing them is waste.
        forward_sync_buffers=False,
    )


def reduces_gradients(zero: int, last_pass: bool) -> bool:
    """Whether a pass of gradient accumulation reduces the data-parallel gradients: the last one, and under ZeRO-2
    every one, since it keeps only its shard of them."""
    return last_pass or zero == 2


@contextlib.contextmanager
def accumulation_pass(module: nn.Module, zero: int, last_pass: bool) -> Iterator[None]:
    """A forward and backward pass that reduces the data-parallel gradients (reduces_gradients) or only accumulates
    them, as the inner passes of gradient accumulation do: DDP's no_sync, or FSDP2 skipping its reduce-scatter
    (and HSDP its all-reduce) until a pass that enables it again. ZeRO-1 also keeps the gathered parameters from
    one pass to the next, so a step gathers them once."""
    reduced = reduces_gradients(zero, last_pass)
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(reduced)
        if zero == 1:
            module.set_reshard_after_backward(last_pass)
    if isinstance(module, DistributedDataParallel) and not reduced:
        with module.no_sync():
            yield
    else:
        yield
