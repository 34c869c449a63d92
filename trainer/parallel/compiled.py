"""Activation checkpointing and torch.compile per transformer block, under any layout.

The order is checkpointing, then compile, except where torch 2.13 cannot compile what checkpointing
leaves: under tensor parallelism a checkpointed block that redistributes DTensors does not compile
(AOTAutograd finds a DeviceMesh among the tensors it saves), so there the compiled block is checkpointed
instead. (Selective recompute under tensor parallelism would need the attention compiled on its own and
then checkpointed; torch 2.13 computes wrong gradients for that from its compile cache, so the config
refuses compile with that pair.)

Under tensor parallelism the embedding's output also reaches the first block as an AsyncCollectiveTensor:
RowwiseParallel issues its reduce-scatter async and `to_local()` hands back the waiting wrapper. Taken as
the input of a compiled region, that wrapper makes AOTAutograd return a plain tensor as its gradient, and
the embedding's redistribute backward, which expects a DTensor, fails (`'Tensor' object has no attribute
'_local_tensor'`). So the embedding's output is settled into a plain tensor before any compiled code."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from trainer.config import ComputeConfig
from trainer.model import Transformer
from trainer.moe import MoEFeedForward

from .recompute import apply_recompute


def recompute_and_compile(part: Transformer, compute: ComputeConfig, tensor_parallel: bool) -> None:
    if not compute.compile:
        apply_recompute(part, compute)
        return
    if tensor_parallel and part.embedding is not None:
        part.embedding.register_forward_hook(_settled)
    checkpoint_compiled_code = tensor_parallel and compute.recompute == "full"
    if not checkpoint_compiled_code:
        apply_recompute(part, compute)
    for block in part.blocks.values():
        if isinstance(block.mlp, MoEFeedForward):
            # Routing's shapes depend on the data (how many tokens each expert takes; expert parallelism's splits),
            # so a mixture of experts runs eagerly between the compiled attention and norms.
            block.mlp.forward = torch.compiler.disable(block.mlp.forward)
        block.compile()
    if checkpoint_compiled_code:
        apply_recompute(part, compute)


def _settled(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    # clone() is no view, so the wrapper waits and returns a plain tensor; autograd records the clone on the
    # wrapper itself, so the gradient still flows back through to_local() as a DTensor.
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output
