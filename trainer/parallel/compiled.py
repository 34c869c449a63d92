"""torch.compile per transformer block, under any layout.

Under tensor parallelism the embedding's output reaches the first block as an AsyncCollectiveTensor:
RowwiseParallel issues its reduce-scatter async and `to_local()` hands back the waiting wrapper. Taken as
the input of a compiled region, that wrapper makes AOTAutograd return a plain tensor as its gradient, and
the embedding's redistribute backward, which expects a DTensor, fails (torch 2.13: `'Tensor' object has no
attribute '_local_tensor'`). So the embedding's output is settled into a plain tensor, outside any
compiled region, before the blocks see it."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from trainer.model import Transformer


def compile_blocks(part: Transformer) -> None:
    for block in part.blocks.values():
        block.compile()
    if part.embedding is not None:
        part.embedding.register_forward_hook(_settled)


def _settled(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    # clone() is no view, so the wrapper waits and returns a plain tensor; autograd records the clone on the
    # wrapper itself, so the gradient still flows back through to_local() as a DTensor.
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output
