"""Choosing the implementation of the fused ops: Triton kernels on CUDA, their plain-torch definitions elsewhere."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer.kernels import reference
from trainer.kernels.chunked_cross_entropy import TORCH_LOGITS_STEPS, LogitsSteps, chunked_cross_entropy

BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class KernelSet:
    """One implementation of each fused op; all of them compute the functions in trainer.kernels.reference."""

    backend: str
    """"triton" or "torch": which implementation this set holds."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    """(x [..., dim], weight [dim], eps) -> x / sqrt(mean(x²) + eps) * weight, in x's dtype."""

    swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(gate, up) -> silu(gate) * up."""

    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    """(x [B, H, T, D], cos [T, D], sin [T, D]) -> x * cos + rotate_half(x) * sin; apply to q and to k."""

    cross_entropy: Callable[..., torch.Tensor]
    """(hidden [..., dim], weight [vocab, dim], targets [...], ignore_index=-100, chunk_size=None) -> mean fp32
    loss of the logits hidden @ weight.T, computed chunk_size rows at a time so they never all exist."""


TORCH_KERNELS = KernelSet(
    backend="torch",
    rms_norm=reference.rms_norm,
    swiglu=reference.swiglu,
    rotary=reference.rotary,
    cross_entropy=chunked_cross_entropy,
)


def triton_importable() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def triton_interpreted() -> bool:
    """TRITON_INTERPRET=1 runs Triton kernels on CPU tensors, slowly: how tests exercise them without a GPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _triton_kernels() -> KernelSet:
    # Imported here, not at module load: the trainer must run where Triton is not installed.
    from trainer.kernels import cross_entropy, rmsnorm, rope, swiglu

    return KernelSet(
        backend="triton",
        rms_norm=rmsnorm.rms_norm,
        swiglu=swiglu.swiglu,
        rotary=rope.rotary,
        cross_entropy=cross_entropy.cross_entropy,
    )


def logits_steps(kernels: KernelSet) -> LogitsSteps:
    """The per-chunk softmax work of this set's cross-entropy, for the losses built on the same chunk loop
    (trainer.kernels.vocab_parallel_cross_entropy)."""
    if kernels.backend == "torch":
        return TORCH_LOGITS_STEPS
    from trainer.kernels.cross_entropy import TRITON_LOGITS_STEPS

    return TRITON_LOGITS_STEPS


def kernels_for(backend: str, device: torch.device) -> KernelSet:
    """The fused ops to use on `device`.

    "auto": Triton on a CUDA device when Triton is installed, else torch. "torch": the plain-torch definitions
    (cross-entropy still chunked). "triton": Triton, or an error saying why it cannot run here.
    """
    device = torch.device(device)
    if backend == "torch":
        return TORCH_KERNELS
    if backend == "auto":
        return _triton_kernels() if device.type == "cuda" and triton_importable() else TORCH_KERNELS
    if backend == "triton":
        if not triton_importable():
            raise RuntimeError(
                "kernels backend 'triton' needs the triton package, which is not installed: "
                "pip install triton, or use kernels backend 'auto' or 'torch'"
            )
        if device.type != "cuda" and not triton_interpreted():
            raise RuntimeError(
                f"kernels backend 'triton' needs a CUDA device, but the model is on {device.type}: use kernels "
                "backend 'auto' or 'torch' here (or set TRITON_INTERPRET=1 to run the kernels, slowly, on CPU)"
            )
        return _triton_kernels()
    raise ValueError(f"unknown kernels backend {backend!r}; choose one of {', '.join(BACKENDS)}")
