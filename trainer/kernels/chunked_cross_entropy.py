"""Cross-entropy of the LM head without the full [rows, vocab] logits.

Rows are processed in chunks: each chunk's logits (hidden_chunk @ weight.T, in the input dtype) live only
while that chunk is worked on. Forward keeps one fp32 logsumexp per row; backward recomputes each chunk's
logits and turns them into their gradient, softmax - onehot, from which it takes that chunk's share of
d_hidden and d_weight. Peak extra memory is O(chunk_size × vocab) whatever the number of rows.

The per-chunk work on the logits is a `LogitsSteps`: plain torch here, Triton kernels in
trainer.kernels.cross_entropy. The chunk loop is the same for both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from trainer.kernels.reference import IGNORE_INDEX


class LogitsSteps(NamedTuple):
    """What one backend does with one chunk of logits [rows, vocab] and its targets [rows]. A target outside
    [0, vocab) that is not ignore_index is a row whose target lies in another rank's share of the vocabulary
    (trainer.kernels.vocab_parallel_cross_entropy): it has no target logit here, but its softmax counts."""

    losses_and_logsumexp: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
    """(logits, targets, ignore_index) -> fp32 per-row logsumexp − target logit (0 on ignored rows and where the
    target is not in [0, vocab)) and fp32 per-row logsumexp."""

    logits_gradient: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
    """(logits, targets, logsumexp, scale, ignore_index) -> (softmax - onehot) * scale in the logits' dtype,
    zero on ignored rows, no onehot where the target is not in [0, vocab); scale is a one-element fp32 tensor.
    May overwrite and return `logits`."""


def torch_losses_and_logsumexp(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    logsumexp = logits.logsumexp(dim=-1)
    here = (targets != ignore_index) & (targets >= 0) & (targets < logits.shape[1])
    target_logits = logits.gather(1, targets.where(here, 0).unsqueeze(1)).squeeze(1)
    return torch.where(here, logsumexp - target_logits, 0.0), logsumexp


def torch_logits_gradient(
    logits: torch.Tensor, targets: torch.Tensor, logsumexp: torch.Tensor, scale: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    here = (targets >= 0) & (targets < logits.shape[1])
    gradient = (logits.float() - logsumexp.unsqueeze(1)).exp_()
    rows = torch.arange(len(targets), device=targets.device)
    gradient[rows[here], targets[here]] -= 1.0
    gradient *= torch.where(targets != ignore_index, scale, 0.0).unsqueeze(1)
    return gradient.to(logits.dtype)


TORCH_LOGITS_STEPS = LogitsSteps(torch_losses_and_logsumexp, torch_logits_gradient)


# Fewer rows than this make each chunk's matmul too small to use the device well.
MIN_DEFAULT_CHUNK_ROWS = 256


def default_chunk_size(rows: int, dim: int, vocab: int) -> int:
    """Rows per chunk such that one chunk's logits take about as much memory as the hidden states do."""
    return max(1, min(rows, max(MIN_DEFAULT_CHUNK_ROWS, rows * dim // vocab)))


def chunk_losses(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int, chunk_size: int, steps
) -> tuple[torch.Tensor, torch.Tensor]:
    """`steps.losses_and_logsumexp` of every row of hidden @ weight.T, chunk_size rows of logits at a time."""
    losses = torch.empty(len(targets), dtype=torch.float32, device=hidden.device)
    logsumexp = torch.empty(len(targets), dtype=torch.float32, device=hidden.device)
    for start in range(0, len(targets), chunk_size):
        rows = slice(start, start + chunk_size)
        losses[rows], logsumexp[rows] = steps.losses_and_logsumexp(hidden[rows] @ weight.T, targets[rows], ignore_index)
    return losses, logsumexp


def chunk_gradients(ctx, hidden, weight, targets, logsumexp, scale) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients of hidden and weight from (softmax - onehot) * scale, recomputing each chunk's logits;
    only those autograd asks for (`ctx.needs_input_grad`)."""
    wants_hidden, wants_weight = ctx.needs_input_grad[:2]
    grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if wants_hidden else None
    # fp32 so that summing many chunks' contributions does not round at every step in bf16.
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if wants_weight else None
    for start in range(0, len(targets), ctx.chunk_size):
        rows = slice(start, start + ctx.chunk_size)
        grad_logits = ctx.steps.logits_gradient(
            hidden[rows] @ weight.T, targets[rows], logsumexp[rows], scale, ctx.ignore_index
        )
        if wants_hidden:
            torch.matmul(grad_logits, weight, out=grad_hidden[rows])
        if wants_weight:
            grad_weight += grad_logits.T @ hidden[rows]
    return grad_hidden, grad_weight.to(weight.dtype) if wants_weight else None


class ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, chunk_size, steps):
        losses, logsumexp = chunk_losses(hidden, weight, targets, ignore_index, chunk_size, steps)
        # A tensor, not a Python int: reading it on the host would stall the GPU stream.
        valid_rows = (targets != ignore_index).sum()
        ctx.save_for_backward(hidden, weight, targets, logsumexp, valid_rows)
        ctx.ignore_index, ctx.chunk_size, ctx.steps = ignore_index, chunk_size, steps
        return losses.sum() / valid_rows

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, targets, logsumexp, valid_rows = ctx.saved_tensors
        scale = (grad_loss.float() / valid_rows).reshape(1)
        return *chunk_gradients(ctx, hidden, weight, targets, logsumexp, scale), None, None, None, None


def rows_of(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int | None, vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """hidden as [rows, dim] and targets as [rows], both cast as autocast would cast the product, and the rows
    per chunk (None: `default_chunk_size` for this vocabulary); ValueError on shapes that do not match."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1)
    if len(hidden) != len(targets):
        raise ValueError(f"hidden has {len(hidden)} rows but targets has {len(targets)}; they must match")
    if chunk_size is None:
        chunk_size = default_chunk_size(len(hidden), hidden.shape[1], vocab)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of rows, got {chunk_size}")
    if torch.is_autocast_enabled(hidden.device.type):
        # Autocast is off during backward: cast now, so that backward recomputes the very logits forward saw.
        compute_dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(compute_dtype), weight.to(compute_dtype)
    return hidden, weight, targets, chunk_size


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
    steps: LogitsSteps = TORCH_LOGITS_STEPS,
) -> torch.Tensor:
    """Mean fp32 cross-entropy of hidden [..., dim] @ weight [vocab, dim].T against targets [...], ignoring
    rows whose target is ignore_index; chunk_size rows at a time (None: see default_chunk_size)."""
    hidden, weight, targets, chunk_size = rows_of(hidden, weight, targets, chunk_size, weight.shape[0])
    return ChunkedCrossEntropy.apply(hidden, weight, targets, ignore_index, chunk_size, steps)
