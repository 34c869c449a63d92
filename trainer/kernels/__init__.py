"""Fused ops for the model: Triton kernels on CUDA, plain torch elsewhere, the same results either way.

    kernels = kernels_for(backend, device)   # backend: "auto" | "triton" | "torch"
    kernels.rms_norm(x, weight, eps); kernels.swiglu(gate, up); kernels.rotary(x, cos, sin)
    kernels.cross_entropy(hidden, weight, targets, ignore_index=-100, chunk_size=None)

trainer.kernels.reference holds the definitions. The Triton modules (rmsnorm, swiglu, rope, cross_entropy)
import triton and are loaded only when kernels_for picks them. Attention is not here: the model's
scaled_dot_product_attention already dispatches to flash attention on CUDA, and AdamW's fused=True is
torch's own fused optimizer step.
"""

from trainer.kernels.backends import BACKENDS, TORCH_KERNELS, KernelSet, kernels_for, logits_steps

__all__ = ["BACKENDS", "TORCH_KERNELS", "KernelSet", "kernels_for", "logits_steps"]
