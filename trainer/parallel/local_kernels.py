"""The fused ops under tensor parallelism, on each rank's local shard.

Tensor parallelism hands the kernels plain tensors everywhere but at the norms: the column-parallel projections
return their local shards (so the rotary embedding runs on the rank's heads and SwiGLU on its columns of the
MLP, as they are), while a norm takes the residual stream as a DTensor: Shard(1), the rank's share of the
sequence, under sequence parallelism, or the replicated whole. RMSNorm is row-wise, so the local rows are enough:
the kernel runs on them and its output is the same DTensor again. Its weight's gradient is then, like the one
DTensor's own ops give, a Partial sum over the ranks' rows where the rows are sharded, and whole where they are
replicated.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

from trainer.kernels import KernelSet


class _Waited(torch.autograd.Function):
    """A collective's output, waited for inside autograd: the gradient passes through."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.trigger_wait()

    @staticmethod
    def backward(ctx, grad):
        return grad


class _GradientWaited(torch.autograd.Function):
    """The tensor as it is, its gradient waited for if a collective left it pending: the gradient that reaches a
    DTensor's local tensor can be an AsyncCollectiveTensor (a pipeline stage's first backward, which infers
    gradient shapes, hands one there), which a Triton kernel cannot read."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad.trigger_wait() if isinstance(grad, AsyncCollectiveTensor) else grad


def local_part(tensor: DTensor, grad_placements: list[Placement]) -> torch.Tensor:
    """The DTensor's local tensor, as a plain tensor the kernels can take, whose gradient reaches the DTensor as
    `grad_placements`. (A reduce-scatter or all-gather leaves an AsyncCollectiveTensor there, and its own wait(),
    which local_map calls, is outside autograd.)"""
    local = tensor.to_local(grad_placements=grad_placements)
    return _Waited.apply(local) if isinstance(local, AsyncCollectiveTensor) else local


def on_local_shards(kernels: KernelSet) -> KernelSet:
    """`kernels` with an RMSNorm that takes DTensor activations (and plain ones, unchanged)."""

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not isinstance(x, DTensor):
            return kernels.rms_norm(x, weight, eps)
        placements = list(x.placements)
        weight_gradient = [Partial()] if any(placement.is_shard() for placement in placements) else [Replicate()]
        out = kernels.rms_norm(local_part(x, placements), local_part(weight, weight_gradient), eps)
        return DTensor.from_local(_GradientWaited.apply(out), x.device_mesh, placements, run_check=False)

    return replace(kernels, rms_norm=rms_norm)
