"""The planner's memory and step-time estimates against the trainer's own measurements on one GPU: for each
config the real trainer runs a few steps under torchrun (one rank), its metric events give the peak of
torch.cuda.max_memory_allocated and the median step time, and trainer.plan estimates the same config for this
GPU. Prints per config measured vs estimated and the error; writes everything to a JSON file.

    python benchmarks/gpu/memory_check.py OUT.json --gpu H100-SXM   # on a GPU
    python benchmarks/gpu/memory_check.py OUT.json --dry-run         # two tiny configs on CPU: the wiring only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from trainer.plan.estimate import estimate  # noqa: E402
from trainer.telemetry import read_spool  # noqa: E402

GIB = 2**30
STEPS = 6
"""Steps each config runs: the first allocates the optimizer's states, the peak is reached by the second, and the
median step time is taken over steps 3 on."""

MODELS = {
    "125m": {"layers": 12, "dim": 768, "heads": 12, "kv_heads": 12, "ffn": 2048, "vocab": 32000},
    "350m": {"layers": 24, "dim": 1024, "heads": 16, "kv_heads": 8, "ffn": 2816, "vocab": 32000},
    "1b": {"layers": 16, "dim": 2048, "heads": 16, "kv_heads": 8, "ffn": 8192, "vocab": 32000},
    "tiny": {"layers": 2, "dim": 64, "heads": 4, "kv_heads": 2, "ffn": 172, "vocab": 260},
}
# (model, micro_batch, seq_len, recompute, precision)
CASES = [
    ("125m", 4, 1024, "none", "bf16"),
    ("125m", 4, 1024, "selective", "bf16"),
    ("125m", 4, 1024, "full", "bf16"),
    ("125m", 2, 1024, "none", "fp32"),
    ("125m", 16, 512, "none", "bf16"),
    ("350m", 2, 2048, "none", "bf16"),
    ("350m", 2, 2048, "selective", "bf16"),
    ("350m", 8, 2048, "full", "bf16"),
    ("350m", 2, 2048, "full", "fp32"),
    ("1b", 2, 2048, "none", "bf16"),
    ("1b", 4, 2048, "selective", "bf16"),
    ("1b", 8, 2048, "full", "bf16"),
    ("1b", 1, 4096, "none", "bf16"),
    ("1b", 1, 2048, "selective", "fp32"),
]
DRY_RUN_CASES = [("tiny", 2, 64, "none", "fp32"), ("tiny", 2, 64, "full", "fp32")]


def document(model: str, micro_batch: int, seq_len: int, recompute: str, precision: str) -> dict:
    return {
        "steps": STEPS,
        "model": MODELS[model] | {"seq_len": seq_len},
        "data": {"micro_batch": micro_batch},
        "compute": {"recompute": recompute, "precision": precision},
        "optimizer": {"warmup_steps": 1},
        "telemetry": {"comm": False},
    }


def run_case(document: dict, workdir: Path, timeout_s: float) -> dict:
    """Run the config on one rank; the metric events' memory and step times, or the failure's last lines."""
    workdir.mkdir(parents=True)
    config = workdir / "run.json"
    config.write_text(json.dumps(document))
    environ = {key: value for key, value in os.environ.items() if not key.startswith("LOOM_")}
    environ |= {
        "LOOM_SPOOL_DIR": str(workdir / "spool"),
        "OMP_NUM_THREADS": "4",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), environ.get("PYTHONPATH")])),
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        "-m",
        "trainer.train",
        "--config",
        str(config),
    ]
    try:
        finished = subprocess.run(command, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if finished.returncode != 0:
        return {"error": "\n".join((finished.stdout + finished.stderr).splitlines()[-15:])}
    metrics = sorted(
        (event for batch in read_spool(workdir / "spool") for event in batch["events"] if event["kind"] == "metric"),
        key=lambda event: event["step"],
    )
    payloads = [event["payload"] for event in metrics]
    peak_key = "memory_peak" if "memory_peak" in payloads[-1] else "memory_peak_rss"
    return {
        "measured_peak_bytes": max(payload[peak_key] for payload in payloads),
        "peak_measure": peak_key,
        "measured_step_s": statistics.median(payload["step_time_s"] for payload in payloads[2:] or payloads),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="JSON file the results are written to")
    parser.add_argument("--gpu", default="H100-SXM", help="trainer.plan GPU type to estimate for")
    parser.add_argument("--dry-run", action="store_true", help="two tiny configs on CPU: checks the wiring only")
    parser.add_argument("--budget-s", type=float, default=300, help="stop starting configs after this long")
    args = parser.parse_args(argv)
    cases = DRY_RUN_CASES if args.dry_run else CASES
    cluster = {"gpu": args.gpu, "nodes": 1, "gpus_per_node": 1}
    started, results = time.monotonic(), []
    with tempfile.TemporaryDirectory(prefix="memory-check-") as scratch:
        for index, case in enumerate(cases):
            left = args.budget_s - (time.monotonic() - started)
            if left < 10:
                print(f"budget spent: {len(cases) - index} configs not run")
                break
            spec = document(*case)
            planned = estimate(spec, cluster, timeline=False)
            row = {
                "case": dict(zip(("model", "micro_batch", "seq_len", "recompute", "precision"), case, strict=True)),
                "estimated_peak_bytes": planned.peak.allocated_bytes,
                "estimated_step_s": planned.step_s,
                "estimated_terms": {term.name: term.value for term in planned.peak.terms},
            }
            row |= run_case(spec, Path(scratch) / f"case-{index}", min(left, 120))
            results.append(row)
            label = "{model} mb{micro_batch} s{seq_len} {recompute} {precision}".format(**row["case"])
            if "error" in row:
                print(f"{label:32s} FAILED: {row['error']}")
                continue
            memory_error = row["estimated_peak_bytes"] / row["measured_peak_bytes"] - 1
            time_error = row["estimated_step_s"] / row["measured_step_s"] - 1
            print(
                f"{label:32s} peak measured {row['measured_peak_bytes'] / GIB:7.2f} GiB, estimated "
                f"{row['estimated_peak_bytes'] / GIB:7.2f} GiB ({memory_error:+.1%}); step measured "
                f"{row['measured_step_s'] * 1e3:8.1f} ms, estimated {row['estimated_step_s'] * 1e3:8.1f} ms "
                f"({time_error:+.1%})"
            )
    args.output.write_text(json.dumps({"gpu_type": args.gpu, "cases": results}, indent=1))
    measured = [row for row in results if "error" not in row]
    if measured:
        errors = [abs(row["estimated_peak_bytes"] / row["measured_peak_bytes"] - 1) for row in measured]
        print(f"memory: {len(measured)} configs, mean |error| {statistics.mean(errors):.1%}, worst {max(errors):.1%}")
    return 0 if len(measured) == len(results) and results else 1


if __name__ == "__main__":
    sys.exit(main())
