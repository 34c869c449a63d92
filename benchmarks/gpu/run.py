"""Everything loom measures on a GPU, in one command: run it first whenever a GPU is at hand.

    python benchmarks/gpu/run.py OUTDIR             # on a machine with one GPU, inside 8 minutes on an H100
    python benchmarks/gpu/run.py OUTDIR --dry-run   # on CPU, tiny sizes: checks the script's own wiring (CI)

Parts, in order, each a subprocess with its own time cap whose output goes to OUTDIR/<part>.log:
  gemm        benchmarks/gpu/gemm_sweep.py: matrix-product efficiency over the planner's shapes, bf16 and fp8,
              attention and copy bandwidth (OUTDIR/gemm.json); calibrates trainer.plan's compute model
  memory      benchmarks/gpu/memory_check.py: the trainer's measured peak memory and step time against the
              planner's estimate for 14 single-GPU configs (OUTDIR/memory.json)
  throughput  benchmarks/throughput.py --config 1b: loom against Hugging Face's Llama, tokens/s and MFU; then
              benchmarks/gpu/fp8_check.py: bf16 against fp8 matmuls (tensorwise, rowwise), tokens/s and loss; then
              benchmarks/gpu/moe_check.py: a DeepSeek-V3-16B-shaped mixture of experts against a dense model of its
              active width, tokens/s, MFU and peak memory, each beside the planner's estimate
  kernels     the Triton kernel tests compiled on CUDA (tests/trainer/test_kernels.py), then benchmarks/kernels.py:
              each kernel fused against eager torch and torch.compile at the 1B config's TP-1 and TP-8 local
              shapes, and the fused cross-entropy's peak memory at vocabulary 128,256
  profile     benchmarks/gpu/profile_step.py: a 1b step's device time by kind of kernel, and how long the GPU
              sat idle, beside the planner's estimate of the same step
OUTDIR/summary.txt records the device, driver and library versions, then each part's exit status and time.
A part that fails or runs out of time does not stop the others. Eight files in all: what a lent GPU machine
hands back.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU_TYPE_BY_NAME = (
    ("H200", "H200"),
    ("H100 PCIe", "H100-PCIe"),
    ("H100", "H100-SXM"),
    ("B200", "B200"),
    ("A100-SXM4-40GB", "A100-40GB"),
    ("A100", "A100-80GB"),
)


def planner_gpu_type() -> str:
    """trainer.plan's name for the GPU in this machine (H100-SXM where it has none: the dry run)."""
    import torch

    if not torch.cuda.is_available():
        return "H100-SXM"
    name = torch.cuda.get_device_name()
    return next((gpu for marker, gpu in GPU_TYPE_BY_NAME if marker in name), "H100-SXM")


def parts(out: Path, gpu: str, dry_run: bool) -> list[tuple[str, list[list[str]], float]]:
    """(name, commands run one after the other, seconds allowed for all of them)."""
    python = sys.executable
    flag = ["--dry-run"] if dry_run else []
    pytest = [
        python,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--noconftest",
        "-o",
        "addopts=",
        "tests/trainer/test_kernels.py",
    ]
    throughput = ["--config", "tiny", "--steps", "2"] if dry_run else ["--config", "1b"]
    memory = [python, "benchmarks/gpu/memory_check.py", str(out / "memory.json"), "--gpu", gpu, "--budget-s", "100"]
    return [
        (
            "gemm",
            [[python, "benchmarks/gpu/gemm_sweep.py", str(out / "gemm.json"), "--gpu", gpu, "--budget-s", "60", *flag]],
            75,
        ),
        ("memory", [memory + flag], 110),
        (
            "throughput",
            [
                [python, "benchmarks/throughput.py", *throughput],
                [python, "benchmarks/gpu/fp8_check.py", *flag],
                [python, "benchmarks/gpu/moe_check.py", "--gpu", gpu, *flag],
            ],
            150,
        ),
        (
            "kernels",
            [pytest + (["--collect-only"] if dry_run else []), [python, "benchmarks/kernels.py", *flag]],
            100,
        ),
        ("profile", [[python, "benchmarks/gpu/profile_step.py", "--gpu", gpu, *flag]], 45),
    ]


def environment_report() -> str:
    import torch

    lines = [
        f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"python: {sys.version.split()[0]}",
        f"torch: {torch.__version__} (CUDA {torch.version.cuda})",
    ]
    try:
        import triton

        lines.append(f"triton: {triton.__version__}")
    except ImportError:
        lines.append("triton: not installed")
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        lines.append(
            f"device: {properties.name}, {properties.total_memory / 2**30:.1f} GiB, "
            f"{properties.multi_processor_count} SMs, capability {properties.major}.{properties.minor}"
        )
        try:
            lines.append(
                subprocess.run(
                    ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,power.limit", "--format=csv"],
                    capture_output=True,
                    text=True,
                    timeout=20,
                ).stdout.strip()
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            lines.append(f"nvidia-smi: {error}")
    else:
        lines.append("device: cpu (no GPU)")
    return "\n".join(lines) + "\n"


def run_part(name: str, commands: list[list[str]], allowed_s: float, out: Path, environ: dict) -> tuple[str, bool]:
    """Run the part's commands into OUTDIR/<name>.log; a one-line summary of how it ended, and whether every
    command exited 0."""
    started = time.monotonic()
    codes = []
    with (out / f"{name}.log").open("w") as log:
        for command in commands:
            left = allowed_s - (time.monotonic() - started)
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            if left <= 1:
                log.write("not run: the part's time is spent\n")
                codes.append("not run")
                continue
            try:
                codes.append(
                    str(
                        subprocess.run(
                            command, cwd=ROOT, env=environ, stdout=log, stderr=subprocess.STDOUT, timeout=left
                        ).returncode
                    )
                )
            except subprocess.TimeoutExpired:
                log.write(f"\ntimed out after {allowed_s:.0f} s\n")
                codes.append("timed out")
    line = f"{name:11s} exit {', '.join(codes):20s} {time.monotonic() - started:6.1f} s"
    return line, all(code == "0" for code in codes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path, help="directory every result is written to")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU: check the wiring, measure nothing")
    parser.add_argument("--only", nargs="+", help="run only these parts (gemm, memory, throughput, kernels, profile)")
    args = parser.parse_args(argv)
    args.outdir.mkdir(parents=True, exist_ok=True)
    out = args.outdir.resolve()
    environment = environment_report()
    environ = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    import torch

    if not torch.cuda.is_available():
        # Without a GPU the Triton kernels can only run in the interpreter, decided when triton is first imported.
        environ["TRITON_INTERPRET"] = "1"
    gpu = planner_gpu_type()
    summary, failed = [], []
    for name, commands, allowed_s in parts(out, gpu, args.dry_run):
        if args.only and name not in args.only:
            continue
        line, ok = run_part(name, commands, allowed_s, out, environ)
        summary.append(line)
        failed += [] if ok else [name]
        print(line, flush=True)
    (out / "summary.txt").write_text(f"{environment}planner GPU type: {gpu}\n" + "\n".join(summary) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
