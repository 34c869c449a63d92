"""Rotary position embedding (rotate-half layout) as a Triton kernel.

Reads x through its strides, so the [B, H, T, D] view the attention makes by transposing [B, T, H, D]
is rotated without a copy. The backward pass is the same kernel applying the transposed rotation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Positions per program: a [16, head_dim / 2] tile per half is enough work per program without spilling.
BLOCK_POSITIONS = 16


@triton.jit
def _rotate(
    x_ptr,
    x_stride_batch,
    x_stride_head,
    x_stride_position,
    out_ptr,
    out_stride_batch,
    out_stride_head,
    out_stride_position,
    cos_ptr,
    sin_ptr,
    heads,
    positions,
    half,
    TRANSPOSE: tl.constexpr,
    BLOCK_POSITIONS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    batch_head = tl.program_id(0).to(tl.int64)
    batch, head = batch_head // heads, batch_head % heads
    position = tl.program_id(1).to(tl.int64) * BLOCK_POSITIONS + tl.arange(0, BLOCK_POSITIONS)[:, None]
    column = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (position < positions) & (column < half)

    x_row = x_ptr + batch * x_stride_batch + head * x_stride_head + position * x_stride_position
    x_first = tl.load(x_row + column, mask=mask, other=0.0).to(tl.float32)
    x_second = tl.load(x_row + half + column, mask=mask, other=0.0).to(tl.float32)
    table_row = position * 2 * half
    cos_first = tl.load(cos_ptr + table_row + column, mask=mask, other=0.0).to(tl.float32)
    cos_second = tl.load(cos_ptr + table_row + half + column, mask=mask, other=0.0).to(tl.float32)
    sin_first = tl.load(sin_ptr + table_row + column, mask=mask, other=0.0).to(tl.float32)
    sin_second = tl.load(sin_ptr + table_row + half + column, mask=mask, other=0.0).to(tl.float32)

    # Forward: out = x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x_second, x_first].
    # Backward multiplies by the transpose of that linear map, whatever the tables hold.
    if TRANSPOSE:
        out_first = x_first * cos_first + x_second * sin_second
        out_second = x_second * cos_second - x_first * sin_first
    else:
        out_first = x_first * cos_first - x_second * sin_first
        out_second = x_second * cos_second + x_first * sin_second

    out_row = out_ptr + batch * out_stride_batch + head * out_stride_head + position * out_stride_position
    tl.store(out_row + column, out_first.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_row + half + column, out_second.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool) -> torch.Tensor:
    batch, heads, positions, dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    # Same strides as x where x is dense, so the caller's later transpose-and-reshape stays a view.
    out = torch.empty_like(x)
    _rotate[(batch * heads, triton.cdiv(positions, BLOCK_POSITIONS))](
        x,
        *x.stride()[:3],
        out,
        *out.stride()[:3],
        cos,
        sin,
        heads,
        positions,
        dim // 2,
        TRANSPOSE=transpose,
        BLOCK_POSITIONS=BLOCK_POSITIONS,
        BLOCK_HALF=triton.next_power_of_2(dim // 2),
    )
    return out


class RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        if x.dim() != 4 or x.shape[-1] % 2:
            raise ValueError(f"x has shape {tuple(x.shape)}; it must be [batch, heads, positions, even head_dim]")
        if cos.shape != x.shape[-2:] or sin.shape != x.shape[-2:]:
            raise ValueError(
                f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be [positions, head_dim] = "
                f"{tuple(x.shape[-2:])}; slice the tables to the sequence length"
            )
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, transpose=False)

    @staticmethod
    def backward(ctx, grad_out):
        cos, sin = ctx.saved_tensors
        return _launch(grad_out, cos, sin, transpose=True), None, None


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+D/2}) of x [B, H, T, D] by the angles whose cos and sin [T, D] are given."""
    return RotaryFunction.apply(x, cos, sin)
