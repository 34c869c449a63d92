"""SwiGLU gating, silu(gate) * up, as elementwise Triton kernels computing in fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _swiglu_forward(gate_ptr, up_ptr, out_ptr, elements, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < elements
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward(grad_out_ptr, gate_ptr, up_ptr, grad_gate_ptr, grad_up_ptr, elements, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < elements
    grad_out = tl.load(grad_out_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    sigmoid = tl.sigmoid(gate)
    silu = gate * sigmoid
    # d silu(g) / dg = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
    grad_gate = grad_out * up * sigmoid * (1.0 + gate * (1.0 - sigmoid))
    tl.store(grad_gate_ptr + offsets, grad_gate.to(grad_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_up_ptr + offsets, (grad_out * silu).to(grad_up_ptr.dtype.element_ty), mask=mask)


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        if gate.shape != up.shape or gate.dtype != up.dtype:
            raise ValueError(
                f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                "must have the same shape and dtype"
            )
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        _swiglu_forward[(triton.cdiv(gate.numel(), BLOCK),)](gate, up, out, gate.numel(), BLOCK=BLOCK)
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
        _swiglu_backward[(triton.cdiv(gate.numel(), BLOCK),)](
            grad_out, gate, up, grad_gate, grad_up, gate.numel(), BLOCK=BLOCK
        )
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up elementwise; gate and up have the same shape and dtype."""
    return SwiGLUFunction.apply(gate, up)
