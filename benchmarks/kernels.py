"""loom's fused Triton kernels against eager torch and torch.compile of the same definitions
(trainer.kernels.reference), forward + backward, at the shapes the 1B benchmark config gives each kernel without
tensor parallelism and the local shapes one rank of TP 8 (with sequence parallelism) gives it; then the fused
cross-entropy's peak memory against the unfused loss's at a Llama-3 vocabulary of 128,256. One line per kernel and
shape, with the eager/fused and compiled/fused ratios (above 1: the fused kernel wins).

    .venv/bin/python benchmarks/kernels.py             # on a CUDA GPU, bf16
    .venv/bin/python benchmarks/kernels.py --dry-run   # on CPU: tiny shapes, Triton interpreted, compile with
                                                       # aot_eager: checks the script's own wiring, times nothing

Under TP 8 the loss runs vocabulary-parallel: here on a one-rank process group over the rank's 1/8 of the
vocabulary, so its two all-reduces of [rows] fp32 (the only communication it adds) cost nothing, and eager and
compiled compute that share's logits whole. Correctness is tests/trainer/test_kernels.py's job (the GPU script runs
it on CUDA first).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

EPS = 1e-5
LLAMA3_VOCAB = 128_256
TENSOR_PARALLEL = 8


@dataclass(frozen=True)
class Shapes:
    """What one kernel call sees: rows = batch × sequence tokens, of the 1B config (benchmarks/throughput.py)."""

    batch: int
    seq_len: int
    dim: int
    heads: int
    head_dim: int
    ffn: int
    vocab: int

    @property
    def rows(self) -> int:
        return self.batch * self.seq_len


# The "1b" config of benchmarks/throughput.py (batch 4 × 2,048 tokens), and a tiny one for the dry run.
ONE_B = Shapes(batch=4, seq_len=2048, dim=2048, heads=16, head_dim=128, ffn=8192, vocab=32000)
TINY = Shapes(batch=2, seq_len=16, dim=32, heads=8, head_dim=8, ffn=64, vocab=96)


@dataclass(frozen=True)
class Case:
    kernel: str
    layout: str
    shape: str
    inputs: list[torch.Tensor]
    fused: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]


def cases(shapes: Shapes, device: torch.device, dtype: torch.dtype, group) -> list[Case]:
    """Each kernel at TP 1 and at one TP-8 rank's local shapes: the norm on its 1/8 of the sequence (sequence
    parallel), SwiGLU on its 1/8 of the MLP's columns, RoPE on its 1/8 of the heads, the loss over its 1/8 of the
    vocabulary with the whole sequence's hidden states."""
    from trainer.kernels import kernels_for, logits_steps, reference
    from trainer.kernels.vocab_parallel_cross_entropy import vocab_parallel_cross_entropy
    from trainer.model import rotary_tables

    fused = kernels_for("triton", device)
    t = TENSOR_PARALLEL

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device=device, dtype=dtype) * scale

    cos, sin = (table.to(device) for table in rotary_tables(shapes.seq_len, shapes.head_dim))
    targets = torch.randint(0, shapes.vocab, (shapes.rows,), device=device)
    share = shapes.vocab // t
    # Targets of the whole vocabulary: about 7 in 8 fall on other ranks' shares, as they do under TP 8.
    local_targets = targets % share

    def norm(rows):
        return [randn(rows, shapes.dim), randn(shapes.dim)]

    def rope(heads):
        return [randn(shapes.batch, shapes.seq_len, heads, shapes.head_dim).transpose(1, 2)]

    def rms_norm(kernels):
        return lambda x, w: kernels.rms_norm(x, w, EPS)

    def rotary(kernels):
        return lambda x: kernels.rotary(x, cos, sin)

    def loss(kernels):
        return lambda h, w: kernels.cross_entropy(h, w, targets)

    def vocab_parallel(h, w):
        return vocab_parallel_cross_entropy(h, w, targets, 0, group, steps=logits_steps(fused))

    def share_loss(h, w):
        return reference.cross_entropy(h, w, local_targets)

    def dims(*sizes):
        return "×".join(str(size) for size in sizes)

    d, rows, ffn, heads, head_dim = shapes.dim, shapes.rows, shapes.ffn, shapes.heads, shapes.head_dim
    by_layout = [("tp1", 1), (f"tp{t} local", t)]
    made = []
    for layout, split in by_layout:
        norm_rows = rows // split
        made.append(Case("rms_norm", layout, dims(norm_rows, d), norm(norm_rows), rms_norm(fused), rms_norm(reference)))
        made.append(
            Case(
                "swiglu",
                layout,
                dims(rows, ffn // split) + " ×2",
                [randn(rows, ffn // split), randn(rows, ffn // split)],
                fused.swiglu,
                reference.swiglu,
            )
        )
        local_heads = heads // split
        made.append(
            Case(
                "rotary",
                layout,
                dims(shapes.batch, local_heads, shapes.seq_len, head_dim),
                rope(local_heads),
                rotary(fused),
                rotary(reference),
            )
        )
    hidden = randn(rows, d)
    made.append(
        Case(
            "cross_entropy",
            "tp1",
            f"{dims(rows, d)} @ {dims(shapes.vocab, d)}ᵀ",
            [hidden, randn(shapes.vocab, d, scale=0.02)],
            loss(fused),
            loss(reference),
        )
    )
    made.append(
        Case(
            "cross_entropy",
            f"tp{t} local",
            f"{dims(rows, d)} @ {dims(share, d)}ᵀ",
            [hidden, randn(share, d, scale=0.02)],
            vocab_parallel,
            share_loss,
        )
    )
    return made


def forward_backward(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor]) -> Callable[[], None]:
    """One forward and a backward from a ones upstream gradient, the leaves' gradients dropped after."""
    leaves = [tensor.detach().requires_grad_() for tensor in inputs]

    def step() -> None:
        out = fn(*leaves)
        out.backward(torch.ones_like(out))
        for leaf in leaves:
            leaf.grad = None

    return step


def median_ms(step: Callable[[], None], on_cuda: bool) -> float:
    if on_cuda:
        from triton.testing import do_bench

        return do_bench(step, return_mode="median")
    step()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def peak_mib(step: Callable[[], None]) -> float:
    """Peak CUDA memory of one forward and backward above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def one_rank_group(on_cuda: bool):
    """A process group of this process alone, for the vocabulary-parallel loss's all-reduces."""
    dist.init_process_group("nccl" if on_cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def compare_times(shapes: Shapes, device: torch.device, dtype: torch.dtype, compile_backend: str, group) -> None:
    on_cuda = device.type == "cuda"
    print(f"forward + backward, median ms: eager torch, torch.compile ({compile_backend}), fused Triton")
    for case in cases(shapes, device, dtype, group):
        compiled = torch.compile(case.reference, backend=compile_backend, dynamic=False)
        eager_ms = median_ms(forward_backward(case.reference, case.inputs), on_cuda)
        compiled_ms = median_ms(forward_backward(compiled, case.inputs), on_cuda)
        fused_ms = median_ms(forward_backward(case.fused, case.inputs), on_cuda)
        ratios = f"eager/fused {eager_ms / fused_ms:5.2f}x  compiled/fused {compiled_ms / fused_ms:5.2f}x"
        print(
            f"{case.kernel:14s} {case.layout:11s} {case.shape:30s} eager {eager_ms:9.3f}  compiled {compiled_ms:9.3f}"
            f"  fused {fused_ms:9.3f}  {ratios}"
        )


def compare_loss_memory(shapes: Shapes, device: torch.device, dtype: torch.dtype) -> None:
    from trainer.kernels import kernels_for, reference

    fused = kernels_for("triton", device)
    hidden = torch.randn(shapes.rows, shapes.dim, device=device, dtype=dtype)
    weight = torch.randn(LLAMA3_VOCAB, shapes.dim, device=device, dtype=dtype) * 0.02
    targets = torch.randint(0, LLAMA3_VOCAB, (shapes.rows,), device=device)
    full = peak_mib(forward_backward(lambda h, w: reference.cross_entropy(h, w, targets), [hidden, weight]))
    chunked = peak_mib(forward_backward(lambda h, w: fused.cross_entropy(h, w, targets), [hidden, weight]))
    print(
        f"cross_entropy at vocabulary {LLAMA3_VOCAB:,} ({shapes.rows:,} rows × {shapes.dim}): peak memory above the "
        f"inputs, unfused {full:,.0f} MiB, fused {chunked:,.0f} MiB, ratio {full / chunked:.1f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, interpreted Triton: wiring only")
    args = parser.parse_args()
    if args.dry_run:
        # Before Triton is first imported: it reads this once.
        os.environ["TRITON_INTERPRET"] = "1"
        device, dtype, shapes, backend = torch.device("cpu"), torch.float32, TINY, "aot_eager"
    elif torch.cuda.is_available():
        device, dtype, shapes, backend = torch.device("cuda"), torch.bfloat16, ONE_B, "inductor"
    else:
        print("no GPU: correctness is tests/trainer/test_kernels.py's; --dry-run checks this script's wiring")
        return
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run: times mean nothing)"
    print(f"{name}, {str(dtype).removeprefix('torch.')}")
    group = one_rank_group(device.type == "cuda")
    try:
        compare_times(shapes, device, dtype, backend, group)
        if device.type == "cuda":
            compare_loss_memory(shapes, device, dtype)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
