"""RMSNorm as Triton kernels: one program per row forward; backward also sums each program's rows'
share of d_weight, and torch adds up those per-program partial sums."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The interpreter runs programs one after another, so on CPU more of them only add overhead; a few still
# make the backward's split of rows between programs run in tests.
INTERPRETED_PROGRAMS = 4


@triton.jit
def _rms_norm_forward(x_ptr, x_row_stride, weight_ptr, y_ptr, rstd_ptr, columns, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < columns
    x = tl.load(x_ptr + row * x_row_stride + offsets, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / columns + eps)
    tl.store(y_ptr + row * columns + offsets, (x * rstd * weight).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_backward(
    grad_y_ptr,
    grad_y_row_stride,
    x_ptr,
    x_row_stride,
    weight_ptr,
    rstd_ptr,
    grad_x_ptr,
    partial_grad_weight_ptr,
    rows,
    columns,
    rows_per_program,
    BLOCK: tl.constexpr,
):
    program = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < columns
    weight = tl.load(weight_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    partial_grad_weight = tl.zeros([BLOCK], dtype=tl.float32)
    first_row = program * rows_per_program
    last_row = tl.minimum(first_row + rows_per_program, rows)
    for row in range(first_row, last_row):
        x = tl.load(x_ptr + row * x_row_stride + offsets, mask=mask, other=0.0).to(tl.float32)
        grad_y = tl.load(grad_y_ptr + row * grad_y_row_stride + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        grad_x_hat = grad_y * weight
        grad_x = rstd * (grad_x_hat - x_hat * (tl.sum(grad_x_hat * x_hat, axis=0) / columns))
        tl.store(grad_x_ptr + row * columns + offsets, grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)
        partial_grad_weight += grad_y * x_hat
    tl.store(partial_grad_weight_ptr + program * columns + offsets, partial_grad_weight, mask=mask)


def _backward_programs(device: torch.device) -> int:
    """One program per SM keeps every SM busy while leaving few partial d_weight rows to add up."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETED_PROGRAMS


def _as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """A [rows, columns] view with unit column stride (copying only if there is none)."""
    rows = tensor.reshape(-1, tensor.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        if weight.shape != x.shape[-1:]:
            raise ValueError(f"weight has shape {tuple(weight.shape)}; it must be [{x.shape[-1]}], x's last dim")
        x_rows = _as_rows(x)
        rows, columns = x_rows.shape
        y = torch.empty((rows, columns), dtype=x.dtype, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(columns)
        _rms_norm_forward[(rows,)](x_rows, x_rows.stride(0), weight, y, rstd, columns, eps, BLOCK=block)
        ctx.save_for_backward(x_rows, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad_y):
        x_rows, weight, rstd = ctx.saved_tensors
        grad_y_rows = _as_rows(grad_y)
        rows, columns = x_rows.shape
        programs = min(rows, _backward_programs(x_rows.device))
        rows_per_program = triton.cdiv(rows, programs)
        grad_x = torch.empty((rows, columns), dtype=x_rows.dtype, device=x_rows.device)
        partial_grad_weight = torch.empty((programs, columns), dtype=torch.float32, device=x_rows.device)
        _rms_norm_backward[(programs,)](
            grad_y_rows,
            grad_y_rows.stride(0),
            x_rows,
            x_rows.stride(0),
            weight,
            rstd,
            grad_x,
            partial_grad_weight,
            rows,
            columns,
            rows_per_program,
            BLOCK=triton.next_power_of_2(columns),
        )
        grad_weight = partial_grad_weight.sum(dim=0).to(weight.dtype)
        return grad_x.view(grad_y.shape), grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) * weight over the last dimension, which must fit in one block."""
    return RMSNormFunction.apply(x, weight, eps)
