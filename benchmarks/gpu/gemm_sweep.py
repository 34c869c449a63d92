"""Matrix-product efficiency over the shapes the planner prices: what fraction of the GPU's dense peak a transformer
layer's GEMMs reach as hidden size, tensor-parallel degree and tokens per micro-batch change, plus the memory-bound
work beside them (attention through SDPA, a streaming copy). trainer.plan's efficiency curve is calibrated on these.

    python benchmarks/gpu/gemm_sweep.py OUT.json            # on a GPU
    python benchmarks/gpu/gemm_sweep.py OUT.json --dry-run  # a few tiny shapes on CPU: checks the wiring

Every linear layer of a block is three products in a training step: forward (tokens × in → out), the input
gradient (tokens × out → in) and the weight gradient (in × tokens → out, the reduction over tokens). Each is timed
on its own with CUDA events, bf16 in and out with fp32 accumulation (what autocast runs), and reported as achieved
FLOP/s and as a fraction of the datasheet peak the planner uses for this GPU. Where the GPU has fp8 tensor cores,
the forward products also run through torch._scaled_mm in float8_e4m3fn, the rate the planner's fp8 pricing needs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

HIDDEN_SIZES = (1024, 2048, 2304, 3072, 4096, 5120, 6144, 8192, 12288, 16384, 20480, 25600)
TP_DEGREES = (1, 2, 4, 8)
TOKENS = (2048, 8192, 16384)
FP8_TOKENS = (4096, 16384)
# (batch, heads, sequence, head_dim) for attention forward+backward through SDPA, per backend.
ATTENTION_SHAPES = ((1, 16, 2048, 128), (4, 32, 2048, 128), (1, 64, 4096, 128), (2, 8, 8192, 128), (1, 12, 2048, 64))
DRY_RUN_HIDDEN, DRY_RUN_TP, DRY_RUN_TOKENS = (64, 128), (1, 2), (32,)
# Keep each shape's timing near this many seconds of GPU time, at least MIN_REPEATS products.
TARGET_S, MIN_REPEATS, MAX_REPEATS = 0.01, 3, 20


def layer_products(hidden: int, tp: int, tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, m, k, n) of every product of one GPT block's linear layers on one tensor-parallel rank:
    qkv and fc1 are column-parallel (out split), proj and fc2 row-parallel (in split); fc1 is the 4h MLP."""
    linears = {
        "qkv": (hidden, 3 * hidden // tp),
        "proj": (hidden // tp, hidden),
        "fc1": (hidden, 4 * hidden // tp),
        "fc2": (4 * hidden // tp, hidden),
    }
    products = []
    for name, (fan_in, fan_out) in linears.items():
        products.append((f"{name}.forward", tokens, fan_in, fan_out))
        products.append((f"{name}.input_grad", tokens, fan_out, fan_in))
        products.append((f"{name}.weight_grad", fan_in, tokens, fan_out))
    return products


def time_s(fn, flops_hint: float, device: torch.device, peak: float) -> float:
    """Median seconds of fn over repeats sized so the shape costs about TARGET_S of GPU time."""
    fn()
    expected = max(flops_hint / peak, 1e-6)
    repeats = int(min(MAX_REPEATS, max(MIN_REPEATS, TARGET_S / expected)))
    if device.type != "cuda":
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - started)
        return statistics.median(samples)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


def bf16_sweep(device, hidden_sizes, tp_degrees, token_counts, peak, deadline: float) -> list[dict]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for hidden in hidden_sizes:
        if time.monotonic() > deadline:
            print(f"time budget spent: hidden sizes from {hidden} not measured")
            break
        for tp in tp_degrees:
            for tokens in token_counts:
                for name, m, k, n in layer_products(hidden, tp, tokens):
                    a = torch.randn(m, k, device=device, dtype=dtype)
                    b = torch.randn(k, n, device=device, dtype=dtype)
                    run = partial(torch.mm, a, b)
                    rows.append(timed_product(run, (hidden, tp, tokens, name), (m, k, n), device, peak))
    return rows


def timed_product(run, where: tuple, shape: tuple[int, int, int], device: torch.device, peak: float) -> dict:
    """One product timed, with where in the sweep it sits (hidden, tp, tokens, product) and its rate."""
    hidden, tp, tokens, name = where
    m, k, n = shape
    flops = 2.0 * m * k * n
    seconds = time_s(run, flops, device, peak)
    return {
        "hidden": hidden,
        "tp": tp,
        "tokens": tokens,
        "product": name,
        "m": m,
        "k": k,
        "n": n,
        "seconds": seconds,
        "flops_per_s": flops / seconds,
        "efficiency": flops / seconds / peak,
    }


def fp8_sweep(device, hidden_sizes, tp_degrees, token_counts, peak_fp8, deadline: float) -> list[dict]:
    """Forward products in float8_e4m3fn with per-tensor scales, bf16 out: what fp8 training's matmuls run."""
    rows = []
    one = torch.ones((), device=device)
    for hidden in hidden_sizes:
        if time.monotonic() > deadline:
            print(f"time budget spent: fp8 from hidden size {hidden} not measured")
            break
        for tp in tp_degrees:
            for tokens in token_counts:
                for name, m, k, n in layer_products(hidden, tp, tokens):
                    if not name.endswith("forward"):
                        continue
                    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
                    # _scaled_mm wants the second operand column-major.
                    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
                    run = partial(torch._scaled_mm, a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
                    rows.append(timed_product(run, (hidden, tp, tokens, name), (m, k, n), device, peak_fp8))
    return rows


def attention_sweep(device, shapes, peak, backends: tuple[str, ...]) -> list[dict]:
    """Causal SDPA forward+backward: the FLOPs it does (4·b·h·s²·d forward, 2.5× that backward, halved for the
    causal mask) per second, and as a fraction of the matmul peak; with SDPA's own choice of kernel ("default")
    and with each named backend forced (FLASH_ATTENTION is FlashAttention-2, CUDNN_ATTENTION cuDNN's fused
    attention): the planner prices the two apart, and the default row says which one loom's trainer gets."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for backend in backends:
        for batch, heads, seq, head_dim in shapes:
            q, k, v = (
                torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
                for _ in range(3)
            )
            upstream = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype)

            def step(q=q, k=k, v=v, upstream=upstream, backend=backend):
                with sdpa_backend(backend):
                    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                out.backward(upstream)

            flops = 3.5 * 4 * batch * heads * seq * seq * head_dim / 2
            row = {"backend": backend, "batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim}
            try:
                seconds = time_s(step, flops, device, peak)
            except RuntimeError as error:
                # A backend this GPU, dtype or build does not run refuses the call; the row says why.
                rows.append({**row, "error": str(error).splitlines()[0][:200]})
                continue
            rows.append(
                {**row, "seconds": seconds, "flops_per_s": flops / seconds, "efficiency": flops / seconds / peak}
            )
    return rows


def sdpa_backend(name: str):
    """SDPA restricted to one backend by its torch.nn.attention.SDPBackend name; "default" leaves SDPA's choice."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    return nullcontext() if name == "default" else sdpa_kernel(getattr(SDPBackend, name))


def copy_bandwidth(device, elements: int) -> dict:
    """Bytes read plus written per second by a device-to-device copy: the memory-bound roofline's slope."""
    source = torch.empty(elements, device=device, dtype=torch.bfloat16)
    target = torch.empty_like(source)
    bytes_moved = 2.0 * source.numel() * source.element_size()
    seconds = time_s(lambda: target.copy_(source), bytes_moved / 1e3, device, 1.0)
    return {"bytes": bytes_moved, "seconds": seconds, "bytes_per_s": bytes_moved / seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="JSON file the measurements are written to")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU: checks the wiring only")
    parser.add_argument("--gpu", default="H100-SXM", help="trainer.plan GPU type whose peaks efficiency is taken of")
    parser.add_argument("--budget-s", type=float, default=600, help="stop starting larger shapes after this long")
    args = parser.parse_args(argv)
    from trainer.plan.hardware import GPU_TYPES

    gpu = GPU_TYPES[args.gpu]
    if args.dry_run:
        device, shapes = torch.device("cpu"), (DRY_RUN_HIDDEN, DRY_RUN_TP, DRY_RUN_TOKENS)
        attention, elements = ((1, 2, 64, 16),), 1 << 16
    elif torch.cuda.is_available():
        device, shapes, attention, elements = (
            torch.device("cuda"),
            (HIDDEN_SIZES, TP_DEGREES, TOKENS),
            ATTENTION_SHAPES,
            1 << 30,
        )
    else:
        print("gemm_sweep: no GPU; run with --dry-run to check the wiring", file=sys.stderr)
        return 2
    started = time.perf_counter()
    # The bf16 sweep gets two thirds of the budget, the fp8 sweep what is left of the rest.
    bf16_deadline = time.monotonic() + args.budget_s * 2 / 3
    fp8_deadline = time.monotonic() + args.budget_s * 0.9
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "gpu_type": args.gpu,
        "peak_bf16_flops": gpu.peak_bf16_flops,
        "peak_fp8_flops": gpu.peak_fp8_flops,
        "bf16": bf16_sweep(device, *shapes, gpu.peak_bf16_flops, bf16_deadline),
    }
    has_fp8 = device.type == "cuda" and torch.cuda.get_device_capability() >= (8, 9) and gpu.peak_fp8_flops
    fp8_tokens = FP8_TOKENS if not args.dry_run else ()
    result["fp8"] = (
        fp8_sweep(device, shapes[0], shapes[1], fp8_tokens, gpu.peak_fp8_flops, fp8_deadline) if has_fp8 else []
    )
    backends = ("default", "MATH") if args.dry_run else ("default", "FLASH_ATTENTION", "CUDNN_ATTENTION")
    result["attention"] = attention_sweep(device, attention, gpu.peak_bf16_flops, backends)
    result["copy"] = copy_bandwidth(device, elements)
    result["seconds"] = time.perf_counter() - started
    args.output.write_text(json.dumps(result, indent=1))
    for tokens in shapes[2]:
        print(f"bf16 efficiency by hidden size × tp at {tokens} tokens (median over the block's 12 products):")
        for hidden in shapes[0]:
            cells = []
            for tp in shapes[1]:
                values = [
                    row["efficiency"]
                    for row in result["bf16"]
                    if row["hidden"] == hidden and row["tp"] == tp and row["tokens"] == tokens
                ]
                cells.append(f"tp{tp} {statistics.median(values):.3f}" if values else f"tp{tp}   -  ")
            print(f"  h {hidden:6d}: " + "  ".join(cells))
    if result["fp8"]:
        ratios = []
        for row in result["fp8"]:
            twin = next(
                r
                for r in result["bf16"]
                if (r["hidden"], r["tp"], r["tokens"], r["product"])
                == (row["hidden"], row["tp"], row["tokens"], row["product"])
            )
            ratios.append(twin["seconds"] / row["seconds"])
        print(
            f"fp8/bf16 forward speed-up: median {statistics.median(ratios):.2f}x, "
            f"min {min(ratios):.2f}x, max {max(ratios):.2f}x over {len(ratios)} products"
        )
    for row in result["attention"]:
        shape = f"attention {row['backend']} b{row['batch']} h{row['heads']} s{row['seq']} d{row['head_dim']}"
        if "error" in row:
            print(f"{shape}: not run ({row['error']})")
        else:
            print(f"{shape}: {row['flops_per_s'] / 1e12:.0f} TFLOP/s ({row['efficiency']:.3f} of peak)")
    print(f"copy: {result['copy']['bytes_per_s'] / 1e12:.2f} TB/s read+written")
    print(f"gemm_sweep: {len(result['bf16'])} bf16 + {len(result['fp8'])} fp8 products in {result['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
