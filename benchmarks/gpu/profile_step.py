"""Where a loom training step's time goes on a GPU, against the planner's kernel-by-kernel estimate of it.

    python benchmarks/gpu/profile_step.py [--json OUT.json]            # the 1b config on a GPU
    python benchmarks/gpu/profile_step.py --dry-run                    # the tiny config on CPU: the wiring only

Builds loom's model as benchmarks/throughput.py does (same config, AdamW, bf16 autocast, fused kernels), runs
warm-up steps, then profiles a few steps with torch.profiler and sums the device time of every kernel by kind:
matrix products, attention, loom's Triton kernels, the optimizer's multi-tensor kernels, and everything else.
It prints those sums per step beside the planner's (trainer.plan.compute: products, attention, memory-bound
passes, optimizer) and the share of the step the GPU sat idle (the host not keeping up), which the planner
does not price.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.throughput import CONFIGS, SEED, Contender, next_token_targets, token_batches  # noqa: E402
from trainer.kernels import kernels_for  # noqa: E402
from trainer.model import Transformer  # noqa: E402
from trainer.plan.estimate import estimate  # noqa: E402

PROFILED_STEPS = 3
# Kernel names by kind, first match wins: cuBLAS/CUTLASS products, flash and cuDNN attention, loom's Triton
# kernels, the foreach/fused optimizer kernels.
KINDS = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("matrix products", ("gemm", "cutlass", "xmma", "nvjet", "wgmma", "matmul", "sm90", "sm80")),
    ("triton kernels", ("triton", "_kernel")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
)


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    return next((kind for kind, markers in KINDS if any(marker in name for marker in markers)), "other")


def device_time_by_kind(profile: torch.profiler.profile, steps: int) -> dict[str, float]:
    """Seconds of device time per step by kind of kernel."""
    totals: dict[str, float] = {}
    for event in profile.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0)
        if device_us and event.device_type == torch.autograd.DeviceType.CUDA:
            kind = kind_of(event.key)
            totals[kind] = totals.get(kind, 0.0) + device_us / 1e6 / steps
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    parser.add_argument("--gpu", default="H100-SXM", help="trainer.plan GPU type to estimate for")
    parser.add_argument("--dry-run", action="store_true", help="the tiny config on CPU: checks the wiring only")
    args = parser.parse_args(argv)
    on_cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if on_cuda else "cpu")
    bench = CONFIGS["tiny" if args.dry_run else "1b"]
    cfg = bench.model
    torch.manual_seed(SEED)
    model = Transformer(cfg)
    model.use_kernels(kernels_for("auto", device))
    loom = Contender("loom", model, lambda tokens: model(tokens, next_token_targets(tokens)), device)
    batches = token_batches(bench, device)
    loom.start(batches[: bench.warmup_steps])
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_cuda else [])
    profiled = batches[bench.warmup_steps : bench.warmup_steps + PROFILED_STEPS]
    with torch.profiler.profile(activities=activities) as profile:
        for tokens in profiled:
            loom.timed_step(tokens)
    step_s = statistics.median(loom.step_times_s)
    by_kind = device_time_by_kind(profile, len(profiled)) if on_cuda else {}
    # Unprofiled steps: the profiler's own cost stays out of the step time compared with the planner.
    for tokens in batches[bench.warmup_steps + PROFILED_STEPS :]:
        loom.timed_step(tokens)
    unprofiled_s = statistics.median(loom.step_times_s[len(profiled) :] or loom.step_times_s)

    document = {"model": cfg.model_dump(), "data": {"micro_batch": bench.batch}, "compute": {"precision": "bf16"}}
    planned = estimate(document, {"gpu": args.gpu, "nodes": 1, "gpus_per_node": 1}, timeline=False)
    kernels = planned.ranks[0].compute.kernels
    optimizer_s = next(term.value for term in planned.time_terms if term.name == "optimizer step")
    busy_s = sum(by_kind.values())
    result = {
        "device": torch.cuda.get_device_name() if on_cuda else "cpu",
        "torch": torch.__version__,
        "config": cfg.model_dump() | {"batch": bench.batch},
        "measured_step_s": unprofiled_s,
        "profiled_step_s": step_s,
        "device_busy_s": busy_s,
        "device_time_by_kind_s": by_kind,
        "planned_step_s": planned.step_s,
        "planned_s": {
            "matrix products": kernels.gemm_s,
            "attention": kernels.attention_s,
            "memory-bound passes": kernels.memory_s,
            "optimizer": optimizer_s,
        },
        "at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(
        f"step: measured {unprofiled_s * 1e3:.1f} ms (profiled {step_s * 1e3:.1f} ms), planned "
        f"{planned.step_s * 1e3:.1f} ms"
    )
    if on_cuda:
        print(f"device busy {busy_s * 1e3:.1f} ms of the profiled step: idle {1 - busy_s / step_s:.1%}")
        for kind, seconds in sorted(by_kind.items(), key=lambda item: -item[1]):
            print(f"  {kind:18s} {seconds * 1e3:8.2f} ms")
    print("planned per step:")
    for kind, seconds in result["planned_s"].items():
        print(f"  {kind:18s} {seconds * 1e3:8.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
