"""Cross-entropy of an output layer split over the vocabulary (tensor parallelism's loss parallel), chunked as
trainer.kernels.chunked_cross_entropy is: no rank holds the [rows, vocab] logits, nor all of its own share at once.

Every rank of the group holds the hidden states whole (what a column-parallel output layer takes) and its rows of
the output weight: vocabulary entries [vocab_start, vocab_start + its rows). Forward takes, chunk by chunk, each
row's logsumexp over the rank's own entries and the target's logit where the target is one of them (the same
`LogitsSteps` as the unsplit loss: a target outside the rank's entries has no logit here). Then, for all rows at
once, one all-reduce of the maxima and one of the rescaled sums with the target logits turn those into the
logsumexp over the whole vocabulary: two collectives of [rows] fp32 a call, whatever the chunk count. Backward
recomputes each chunk's local logits and turns them into softmax − onehot with the whole logsumexp. The hidden
states' gradient it returns is this rank's share of it: the group's sum is the gradient, as for the input of any
column-parallel linear layer; the weight's is the gradient of the rank's own rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.kernels.chunked_cross_entropy import (
    TORCH_LOGITS_STEPS,
    LogitsSteps,
    chunk_gradients,
    chunk_losses,
    rows_of,
)
from trainer.kernels.reference import IGNORE_INDEX


def local_targets(targets: torch.Tensor, vocab_start: int, local_vocab: int, ignore_index: int) -> torch.Tensor:
    """Targets as indices into this rank's entries; ignored rows keep ignore_index and rows whose target another
    rank holds get local_vocab (no entry here, and not ignore_index, which must be negative)."""
    shifted = targets - vocab_start
    elsewhere = (shifted < 0) | (shifted >= local_vocab)
    return torch.where(targets == ignore_index, ignore_index, torch.where(elsewhere, local_vocab, shifted))


def whole_vocabulary(
    local_logsumexp: torch.Tensor, target_logits: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logsumexp over the whole vocabulary, the target logit) of every row, from each rank's over its entries and
    its target logit (0 where another rank holds the target)."""
    largest = local_logsumexp.clone()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    sums = torch.stack([(local_logsumexp - largest).exp(), target_logits])
    dist.all_reduce(sums, group=group)
    return largest + sums[0].log(), sums[1]


class VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start, ignore_index, chunk_size, steps, group):
        local = local_targets(targets, vocab_start, weight.shape[0], ignore_index)
        local_losses, local_logsumexp = chunk_losses(hidden, weight, local, ignore_index, chunk_size, steps)
        # Where this rank holds the target: local loss = logsumexp over its entries − the target's logit.
        here = (local >= 0) & (local < weight.shape[0])
        target_logits = torch.where(here, local_logsumexp - local_losses, 0.0)
        logsumexp, target_logits = whole_vocabulary(local_logsumexp, target_logits, group)
        valid = targets != ignore_index
        # A tensor, not a Python int: reading it on the host would stall the GPU stream.
        valid_rows = valid.sum()
        ctx.save_for_backward(hidden, weight, local, logsumexp, valid_rows)
        ctx.ignore_index, ctx.chunk_size, ctx.steps = ignore_index, chunk_size, steps
        return torch.where(valid, logsumexp - target_logits, 0.0).sum() / valid_rows

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, local, logsumexp, valid_rows = ctx.saved_tensors
        scale = (grad_loss.float() / valid_rows).reshape(1)
        grad_hidden, grad_weight = chunk_gradients(ctx, hidden, weight, local, logsumexp, scale)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    group: dist.ProcessGroup,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
    steps: LogitsSteps = TORCH_LOGITS_STEPS,
) -> torch.Tensor:
    """Mean fp32 cross-entropy of hidden [..., dim] @ W.T against targets [...] (whole-vocabulary indices), where
    this rank holds rows [vocab_start, vocab_start + len(weight)) of W and the group's ranks hold the rest; the same
    value on every rank. chunk_size rows at a time (None: see default_chunk_size)."""
    if ignore_index >= 0:
        raise ValueError(f"ignore_index must be negative (a vocabulary index names a token), got {ignore_index}")
    # One chunk of this rank's logits about the size of the hidden states, as for the unsplit loss.
    hidden, weight, targets, chunk_size = rows_of(hidden, weight, targets, chunk_size, weight.shape[0])
    return VocabParallelCrossEntropy.apply(hidden, weight, targets, vocab_start, ignore_index, chunk_size, steps, group)
