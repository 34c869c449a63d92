"""A mixture of experts on this GPU against a dense model of the same active width: the trainer runs each on one
rank for a few steps (bf16), and trainer.plan estimates both for this GPU. Prints per model the measured tokens/s,
MFU (over the FLOPs of the parameters a token is multiplied with), peak memory and step time, the planner's
estimates beside them, and the MoE/dense ratio of tokens/s (also as JSON with --json).

    python benchmarks/gpu/moe_check.py --gpu H100-SXM   # on a GPU
    python benchmarks/gpu/moe_check.py --dry-run        # tiny models on CPU: the script's wiring

The MoE model is DeepSeek-V3-16B's feed-forward shape (64 routed experts of width 1408, top 6, a shared expert,
the first block dense and 10944 wide) cut to 4 blocks, with loom's grouped-query attention in place of
multi-head latent attention; the dense model runs the same 7 experts' width (9856) in every block. torchtitan's
published MoE throughput comes from 8 or more GPUs with expert parallelism (B200, MI325X) and MLA: no config of it
runs on one GPU, so this compares loom's MoE with loom's dense path on the same GPU, the ratio a user plans with.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory_check import GIB, STEPS, run_case  # noqa: E402

from trainer.plan.estimate import estimate  # noqa: E402

ATTENTION = {"dim": 2048, "heads": 16, "kv_heads": 16, "vocab": 102400}
DEEPSEEK_FEED_FORWARD = {
    "ffn": 1408,
    "experts": 64,
    "top_k": 6,
    "moe": {"shared_expert": True, "dense_layers": 1, "dense_ffn": 10944},
}
MODELS = {
    "moe": {"layers": 4, **ATTENTION, **DEEPSEEK_FEED_FORWARD},
    "dense": {"layers": 4, **ATTENTION, "ffn": 7 * 1408},
}
GPU_SHAPE = {"seq_len": 4096, "micro_batch": 2}
DRY_RUN_MODELS = {
    "moe": {"layers": 2, "dim": 64, "heads": 4, "kv_heads": 2, "vocab": 260, "ffn": 32, "experts": 4, "top_k": 2,
            "moe": {"dense_layers": 1, "dense_ffn": 96}},
    "dense": {"layers": 2, "dim": 64, "heads": 4, "kv_heads": 2, "vocab": 260, "ffn": 64},
}  # fmt: skip
DRY_RUN_SHAPE = {"seq_len": 64, "micro_batch": 2}


def document(model: dict, seq_len: int, micro_batch: int, precision: str) -> dict:
    return {
        "steps": STEPS,
        "model": model | {"seq_len": seq_len},
        "data": {"micro_batch": micro_batch},
        "compute": {"precision": precision},
        "optimizer": {"warmup_steps": 1},
        "telemetry": {"comm": False},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--gpu", default="H100-SXM", help="trainer.plan GPU type to estimate for")
    parser.add_argument("--dry-run", action="store_true", help="tiny models on CPU: checks the wiring only")
    args = parser.parse_args(argv)
    models, shape = (DRY_RUN_MODELS, DRY_RUN_SHAPE) if args.dry_run else (MODELS, GPU_SHAPE)
    precision = "fp32" if args.dry_run else "bf16"
    cluster = {"gpu": args.gpu, "nodes": 1, "gpus_per_node": 1}
    tokens_per_step = shape["seq_len"] * shape["micro_batch"]
    results = {}
    with tempfile.TemporaryDirectory(prefix="moe-check-") as scratch:
        for name, model in models.items():
            spec = document(model, shape["seq_len"], shape["micro_batch"], precision)
            planned = estimate(spec, cluster, timeline=False)
            started = time.monotonic()
            row = run_case(spec, Path(scratch) / name, 60)
            row |= {
                "model": model,
                "launch_s": time.monotonic() - started,
                "estimated_peak_bytes": planned.peak.allocated_bytes,
                "estimated_step_s": planned.step_s,
                "estimated_mfu": planned.mfu,
            }
            if "error" in row:
                print(f"{name:6s} FAILED: {row['error']}")
            else:
                # The same FLOPs on the same peak: MFU scales with the inverse of the step time.
                row["measured_mfu"] = planned.mfu * planned.step_s / row["measured_step_s"]
                row["measured_tokens_per_s"] = tokens_per_step / row["measured_step_s"]
                print(
                    f"{name:6s} {row['measured_tokens_per_s']:10,.0f} tokens/s, MFU {row['measured_mfu']:6.1%} "
                    f"(planned {planned.mfu:6.1%}); step {row['measured_step_s'] * 1e3:8.1f} ms (planned "
                    f"{planned.step_s * 1e3:8.1f} ms); peak {row['measured_peak_bytes'] / GIB:6.2f} GiB (planned "
                    f"{planned.peak.allocated_bytes / GIB:6.2f} GiB)"
                )
            results[name] = row
    ratio = None
    if all("measured_tokens_per_s" in row for row in results.values()):
        ratio = results["moe"]["measured_tokens_per_s"] / results["dense"]["measured_tokens_per_s"]
        print(f"MoE/dense tokens/s: {ratio:.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"gpu": args.gpu, "models": results, "moe_over_dense": ratio}, indent=1))
    return 0 if ratio is not None else 1


if __name__ == "__main__":
    sys.exit(main())
