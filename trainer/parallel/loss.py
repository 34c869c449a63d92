"""The chunked cross-entropy under tensor parallelism: the output layer's weight is a DTensor split over the
vocabulary (ColwiseParallel, Shard(0)), so the loss runs trainer.kernels.vocab_parallel_cross_entropy on each
tp rank's rows of it (their local tensors), never making the logits (loss parallel without them).

The hidden states reach it as the output layer would take them: sequence-parallel shards gathered into the whole
sequence, or the replicated tensor. Their gradient leaves as a Partial DTensor (each rank's share over its
vocabulary entries), which DTensor reduces back into the layout the hidden states came in: a reduce-scatter under
sequence parallelism, an all-reduce otherwise, as ColwiseParallel's own backward does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from trainer.kernels.chunked_cross_entropy import LogitsSteps
from trainer.kernels.reference import IGNORE_INDEX
from trainer.kernels.vocab_parallel_cross_entropy import vocab_parallel_cross_entropy
from trainer.parallel.local_kernels import local_part


def vocab_start(vocab: int, ranks: int, rank: int) -> int:
    """The first vocabulary entry of `rank`'s Shard(0) rows: DTensor cuts dim 0 as torch.chunk does."""
    rows = -(-vocab // ranks)
    return min(rank * rows, vocab)


def tensor_parallel_cross_entropy(steps: LogitsSteps) -> Callable[..., torch.Tensor]:
    """A `KernelSet.cross_entropy` for an output weight split over the vocabulary on the tp mesh."""

    def cross_entropy(
        hidden: torch.Tensor,
        weight: DTensor,
        targets: torch.Tensor,
        ignore_index: int = IGNORE_INDEX,
        chunk_size: int | None = None,
    ) -> torch.Tensor:
        mesh = weight.device_mesh
        if isinstance(hidden, DTensor):
            hidden = hidden.redistribute(mesh, [Replicate()])
        else:
            hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
        start = vocab_start(weight.shape[0], mesh.size(), mesh.get_local_rank())
        # Each rank's gradient of the hidden states covers its vocabulary entries only: a Partial sum.
        return vocab_parallel_cross_entropy(
            local_part(hidden, [Partial()]),
            local_part(weight, [Shard(0)]),
            targets,
            start,
            mesh.get_group(),
            ignore_index,
            chunk_size,
            steps,
        )

    return cross_entropy
