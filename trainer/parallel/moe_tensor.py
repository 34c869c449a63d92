"""A mixture of experts under tensor and context parallelism.

Tensor parallelism splits each expert's hidden columns over the tp ranks, as Megatron-LM's expert tensor parallelism
does, and keeps the router whole on every rank. The router scores only this rank's part of each sequence (its
sequence-parallel share; without sequence parallelism the block takes one first), so a replicated router weight
gets a partial gradient from each rank; the routing decisions and gates are then gathered, and every rank runs its
slice of the experts on every token. The experts' outputs come back as partial sums, which a reduce-scatter adds
up into each rank's part of the sequence. Gathering the gates sends their gradients, partial too, back to the
rank that routed them as a sum. A shared expert runs as a dense block does under tensor parallelism.

Context and tensor parallelism both leave each rank part of every sequence, so a sequence's routing totals (for
the balance loss) add up over the cp × tp ranks."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.nn.functional import all_reduce
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    PrepareModuleInputOutput,
    parallelize_module,
)

from trainer.model import Transformer
from trainer.moe import MoEFeedForward

from .expert import HIDDEN_DIM, distribute_experts, moe_blocks
from .local_kernels import local_part


def apply_moe_tensor_parallel(moe: MoEFeedForward, tp_mesh: DeviceMesh, between_blocks: Placement) -> None:
    """Replicate the block's router and hand it the sequence collectives; the block takes and returns this rank's
    part of the sequence (a Shard(1) of the stream between blocks). The experts' columns are split apart
    (split_expert_columns, or with expert parallelism apply_expert_parallel), and a shared expert runs as a dense
    block does (tensor.feed_forward_plan)."""
    parts = PrepareModuleInputOutput(
        input_layouts=(between_blocks,),
        desired_input_layouts=(Shard(1),),
        use_local_input=True,
        output_layouts=(Shard(1),),
        desired_output_layouts=(between_blocks,),
        use_local_output=True,
    )
    parallelize_module(moe, tp_mesh, parts)
    whole = distribute_tensor(moe.router.weight.data, tp_mesh, [Replicate()])
    moe.router.weight = nn.Parameter(whole, requires_grad=moe.router.weight.requires_grad)
    moe.gather_sequence = functools.partial(gather_sequence, mesh=tp_mesh)
    moe.reduce_sequence = functools.partial(reduce_sequence, mesh=tp_mesh)
    moe.balance_loss_copies = tp_mesh.size()


def split_expert_columns(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Without expert parallelism (which splits them over ep and tp at once), each rank keeps its columns of every
    expert."""
    for moe in moe_blocks(model):
        distribute_experts(moe, tp_mesh, lambda name: [Shard(HIDDEN_DIM[name])])


def gather_sequence(part: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """[B, T/tp, …] -> [B, T, …]; its gradient, a partial sum on each rank, is added up into each rank's part."""
    whole = DTensor.from_local(part, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()])
    return local_part(whole, [Partial()])


def reduce_sequence(partial: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The ranks' partial [B, T, dim] outputs, added up: this rank's part [B, T/tp, dim]."""
    summed = DTensor.from_local(partial, mesh, [Partial()], run_check=False).redistribute(mesh, [Shard(1)])
    return local_part(summed, [Shard(1)])


def add_up_sequence_parts(model: Transformer, cp_tp_mesh: DeviceMesh) -> None:
    """A router's per-sequence totals are the sum over the ranks holding parts of the sequences (and so are their
    gradients)."""
    group = cp_tp_mesh.get_group()
    for moe in moe_blocks(model):
        moe.whole_sequences = functools.partial(all_reduce, group=group)
