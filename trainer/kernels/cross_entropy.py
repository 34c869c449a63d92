"""The per-chunk softmax work of the chunked cross-entropy as Triton kernels; the matmuls stay in torch.

One program per row streams over the vocabulary in blocks: forward keeps a running max and sum for the
logsumexp, backward overwrites the row's logits with their gradient, so no fp32 copy of a chunk exists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trainer.kernels.chunked_cross_entropy import LogitsSteps, chunked_cross_entropy
from trainer.kernels.reference import IGNORE_INDEX

# Vocabulary entries per step of a row's loop: larger blocks take fewer steps but more registers.
MAX_BLOCK_VOCAB = 8192


@triton.jit
def _losses_and_logsumexp(
    logits_ptr, logits_row_stride, targets_ptr, losses_ptr, logsumexp_ptr, vocab, ignore_index, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    row_logits_ptr = logits_ptr + row * logits_row_stride
    running_max = tl.full([], float("-inf"), dtype=tl.float32)
    running_sum = tl.full([], 0.0, dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        logits = tl.load(row_logits_ptr + offsets, mask=offsets < vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(logits, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(logits - new_max), axis=0)
        running_max = new_max
    logsumexp = running_max + tl.log(running_sum)

    target = tl.load(targets_ptr + row)
    # Ignored, or (vocabulary-parallel) in another rank's share of the vocabulary: no target logit here.
    here = (target != ignore_index) & (target >= 0) & (target < vocab)
    target_logit = tl.load(row_logits_ptr + target, mask=here, other=0.0).to(tl.float32)
    tl.store(losses_ptr + row, tl.where(here, logsumexp - target_logit, 0.0))
    tl.store(logsumexp_ptr + row, logsumexp)


@triton.jit
def _logits_gradient_in_place(
    logits_ptr, logits_row_stride, targets_ptr, logsumexp_ptr, scale_ptr, vocab, ignore_index, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    row_logits_ptr = logits_ptr + row * logits_row_stride
    target = tl.load(targets_ptr + row)
    logsumexp = tl.load(logsumexp_ptr + row)
    scale = tl.where(target != ignore_index, tl.load(scale_ptr), 0.0)
    for start in range(0, vocab, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < vocab
        logits = tl.load(row_logits_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        onehot = tl.where(offsets == target, 1.0, 0.0)
        gradient = (tl.exp(logits - logsumexp) - onehot) * scale
        tl.store(row_logits_ptr + offsets, gradient.to(logits_ptr.dtype.element_ty), mask=mask)


def _block(vocab: int) -> int:
    return min(triton.next_power_of_2(vocab), MAX_BLOCK_VOCAB)


def triton_losses_and_logsumexp(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, vocab = logits.shape
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    logsumexp = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _losses_and_logsumexp[(rows,)](
        logits, logits.stride(0), targets, losses, logsumexp, vocab, ignore_index, BLOCK=_block(vocab)
    )
    return losses, logsumexp


def triton_logits_gradient(
    logits: torch.Tensor, targets: torch.Tensor, logsumexp: torch.Tensor, scale: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    rows, vocab = logits.shape
    _logits_gradient_in_place[(rows,)](
        logits, logits.stride(0), targets, logsumexp, scale, vocab, ignore_index, BLOCK=_block(vocab)
    )
    return logits


TRITON_LOGITS_STEPS = LogitsSteps(triton_losses_and_logsumexp, triton_logits_gradient)


def cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Chunked mean cross-entropy of hidden @ weight.T, the softmax work in Triton; see chunked_cross_entropy."""
    return chunked_cross_entropy(hidden, weight, targets, ignore_index, chunk_size, TRITON_LOGITS_STEPS)
