"""Plain-torch definitions of the fused ops: what every faster version must compute.

Each one computes in fp32 and returns the input's dtype, which is also what the Triton kernels do, so
a bf16 run differs from these only by the kernels' summation order, never by an extra rounding.
They are the torch backend's forward, with torch's autograd as their backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) * weight over the last dimension."""
    x32 = x.float()
    normalised = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normalised * weight.float()).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, the gating of a SwiGLU feed-forward block."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, rotate-half layout: x [B, H, T, D], cos and sin [T, D]."""
    x32 = x.float()
    return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)


def cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Mean cross-entropy of the logits hidden @ weight.T over the rows whose target is not ignore_index.

    Materialises every logit: the definition the chunked versions are tested against, not one to train with.
    """
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.T
    return F.cross_entropy(logits.float(), targets.reshape(-1), ignore_index=ignore_index)
