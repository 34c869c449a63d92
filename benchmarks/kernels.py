"""Fused Triton kernels against their plain-torch definitions: forward+backward time, and the cross-entropy's peak
memory, on Llama-7B-like shapes in bf16. Prints one line per op with the torch/triton ratio (above 1: Triton wins).

    .venv/bin/python benchmarks/kernels.py

Needs a CUDA GPU; elsewhere the kernels only run in Triton's interpreter, whose speed means nothing, and their
correctness is what tests/trainer/test_kernels.py checks.
"""

from __future__ import annotations

import torch

from trainer.kernels import kernels_for, reference
from trainer.model import rotary_tables

ROWS, DIM, FFN, HEADS, HEAD_DIM, SEQ_LEN, VOCAB = 8 * 2048, 4096, 11008, 32, 128, 2048, 32000
CROSS_ENTROPY_ROWS = 8192
EPS = 1e-5


def forward_backward_ms(fn, inputs) -> float:
    """Median milliseconds of fn(*inputs) followed by a backward pass from a ones upstream gradient."""
    from triton.testing import do_bench  # here: without a GPU this script runs where triton may be absent

    leaves = [tensor.detach().requires_grad_() for tensor in inputs]

    def step():
        out = fn(*leaves)
        out.backward(torch.ones_like(out))
        for leaf in leaves:
            leaf.grad = None

    return do_bench(step, return_mode="median")


def peak_mib(fn, inputs) -> float:
    """Peak CUDA memory of fn's forward and backward above what its inputs already take."""
    leaves = [tensor.detach().requires_grad_() for tensor in inputs]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn(*leaves).backward()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def main() -> None:
    if not torch.cuda.is_available():
        print("no GPU: correctness only (tests/trainer/test_kernels.py); no timings to report")
        return
    device = torch.device("cuda")
    torch_kernels, triton_kernels = kernels_for("torch", device), kernels_for("triton", device)

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16)

    cos, sin = (table.to(device) for table in rotary_tables(SEQ_LEN, HEAD_DIM))
    hidden, weight = randn(CROSS_ENTROPY_ROWS, DIM), randn(VOCAB, DIM) * 0.02
    targets = torch.randint(0, VOCAB, (CROSS_ENTROPY_ROWS,), device=device)
    cases = [
        ("rms_norm", lambda k: lambda x, w: k.rms_norm(x, w, EPS), [randn(ROWS, DIM), randn(DIM)]),
        ("swiglu", lambda k: k.swiglu, [randn(ROWS, FFN), randn(ROWS, FFN)]),
        ("rotary", lambda k: lambda x: k.rotary(x, cos, sin), [randn(8, SEQ_LEN, HEADS, HEAD_DIM).transpose(1, 2)]),
        ("cross_entropy", lambda k: lambda h, w: k.cross_entropy(h, w, targets), [hidden, weight]),
    ]
    print(f"{torch.cuda.get_device_name(device)}, bf16; forward+backward, median ms")
    for name, make, inputs in cases:
        torch_ms = forward_backward_ms(make(torch_kernels), inputs)
        triton_ms = forward_backward_ms(make(triton_kernels), inputs)
        print(f"{name:14s} torch {torch_ms:8.3f}  triton {triton_ms:8.3f}  ratio {torch_ms / triton_ms:5.2f}x")

    full_logits = peak_mib(lambda h, w: reference.cross_entropy(h, w, targets), [hidden, weight])
    chunked = peak_mib(lambda h, w: triton_kernels.cross_entropy(h, w, targets), [hidden, weight])
    print(
        f"cross_entropy peak extra memory: full logits {full_logits:.0f} MiB, chunked {chunked:.0f} MiB, "
        f"ratio {full_logits / chunked:.1f}x"
    )


if __name__ == "__main__":
    main()
