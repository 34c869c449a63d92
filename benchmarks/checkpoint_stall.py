"""How long a checkpoint blocks training: loom's asynchronous save (DCP async_save, state staged to host memory,
written in the background) against its synchronous save (dcp.save, training waits for the whole write), on the same
model and AdamW state, under torchrun with 2 ranks (FSDP dp_shard 2, gloo, CPU). Prints per mode the median time
training is blocked, the median time until the checkpoint is committed and its size, and the ratio of the async
stall to the sync save's blocked time (goal: at most 0.05, as PyTorch DCP's async save reports: 148.8 s → 6.3 s).

    .venv/bin/python benchmarks/checkpoint_stall.py            # ~142 M parameters, 1.7 GB per save
    .venv/bin/python benchmarks/checkpoint_stall.py --quick    # ~12.8 M parameters, 160 MB per save

Both modes go through trainer/checkpoint.py's Checkpointer, built as trainer/train.py builds it, after real
optimizer steps so the Adam moments exist. After one warm-up save of each mode (the async stager allocates its
host buffers then), saves alternate async, sync, … so other load on the machine falls on both alike. A save
does not end when training resumes: rank 0 hashes the files, writes the manifest and renames the directory in
the background in both modes, and the async write runs beside training, so training steps continue until it is
committed. Those steps compete with the write for the CPU; the script reports them against steps with no save in
flight as the second figure: the training time a save costs beyond the blocked time. Checkpoints are written
under a temporary directory (--directory, default the system's) and deleted after each is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint import MANIFEST, Checkpointer, read_manifest
from trainer.config import parse_config
from trainer.data.demo import WindowSampler
from trainer.model import Transformer
from trainer.parallel.apply import parallelize
from trainer.parallel.mesh import ParallelMesh
from trainer.telemetry import TelemetryClient
from trainer.train import build_optimizer

ROOT = Path(__file__).resolve().parents[1]
MODES = ("async", "sync")
# (dim, layers); heads of 64 dimensions, half as many key/value heads, Llama's SwiGLU width.
SIZES = {"default": (1024, 12), "quick": (512, 4)}
HEAD_DIM = 64
BYTE_VOCAB = 256
# fp32 parameters and AdamW's two moments.
STATE_BYTES_PER_PARAM = 12
WARMUP_STEPS = 2


def model_section(dim: int, layers: int, seq_len: int) -> dict:
    heads = max(1, dim // HEAD_DIM)
    return {
        "layers": layers,
        "dim": dim,
        "heads": heads,
        "kv_heads": max(1, heads // 2),
        "ffn": -(-8 * dim // 3 // 256) * 256,
        "seq_len": seq_len,
    }


def approximate_params(model: dict) -> int:
    dim, head_dim = model["dim"], model["dim"] // model["heads"]
    attention = 2 * dim * dim + 2 * dim * model["kv_heads"] * head_dim
    return model["layers"] * (attention + 3 * dim * model["ffn"] + 2 * dim) + 2 * BYTE_VOCAB * dim + dim


def run_document(args: argparse.Namespace, mode: str) -> dict:
    return {
        "steps": 1_000_000,
        "model": model_section(args.dim, args.layers, args.seq_len),
        "parallel": {"dp_shard": 2, "backend": "gloo"},
        "compute": {"precision": "fp32"},
        "data": {"micro_batch": args.micro_batch, "corpus_bytes": 300_000},
        # Retirement would delete inside the timed commit; the script deletes each checkpoint after measuring it.
        "checkpoint": {
            "directory": str(Path(args.directory) / mode),
            "keep_last": 1_000,
            "async_save": mode == "async",
        },
    }


# The two ranks, under torchrun.


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, device = dist.get_rank(), torch.device("cpu")
    configs = {mode: parse_config(run_document(args, mode)) for mode in MODES}
    config = configs["async"]
    mesh = ParallelMesh(config.parallel, dist.get_world_size(), device.type)
    torch.manual_seed(config.data.seed)
    model = Transformer(config.model)
    params = model.num_params()
    parallel_model = parallelize(model, mesh, config, device)
    optimizer = build_optimizer(parallel_model.parameters(), config.optimizer)
    sampler = WindowSampler.from_config(config)
    telemetry = TelemetryClient(
        url=None,
        token=None,
        attempt=None,
        rank=rank,
        spool_dir=Path(args.directory) / "spool",
        flush_interval_s=config.telemetry.flush_interval_s,
        heartbeat_interval_s=None,
    )
    checkpointers = {
        mode: Checkpointer(
            configs[mode],
            parallel_model.state_modules,
            optimizer,
            telemetry,
            device,
            root=Path(configs[mode].checkpoint.directory),
            run_id=None,
            attempt=None,
        )
        for mode in MODES
    }
    step, loss = 0, 0.0

    def train_step(in_flight=None, checkpointer: Checkpointer | None = None) -> tuple[float, bool]:
        """One step as trainer/train.py takes it; also whether a save is still in flight on any rank."""
        nonlocal step, loss
        step += 1
        started = time.perf_counter()
        inputs, targets = sampler.batch(step, mesh.dp_rank, config.parallel.data_parallel)
        optimizer.zero_grad(set_to_none=True)
        local_loss = parallel_model.forward_backward(inputs, targets)
        if checkpointer is not None:
            checkpointer.before_update()
        optimizer.step()
        pending = in_flight is not None and not in_flight.done()
        shared = torch.tensor([local_loss.item(), float(pending)], dtype=torch.float64)
        dist.all_reduce(shared)
        loss = shared[0].item() / dist.get_world_size()
        return time.perf_counter() - started, bool(shared[1].item())

    def measure_save(mode: str) -> dict:
        checkpointer = checkpointers[mode]
        checkpointer.save(step, loss)
        pending = checkpointer.pending
        finished = pending.committed or pending.upload
        finished_at: list[float] = []
        finished.add_done_callback(lambda _: finished_at.append(time.perf_counter()))
        in_flight_steps = []
        while True:
            elapsed, still_in_flight = train_step(finished, checkpointer)
            in_flight_steps.append(elapsed)
            if not still_in_flight:
                break
        checkpointer.wait()
        stall = torch.tensor([pending.stall_s], dtype=torch.float64)
        dist.all_reduce(stall, op=dist.ReduceOp.MAX)
        saved_bytes = 0
        if rank == 0:
            if not (pending.final / MANIFEST).is_file():
                raise RuntimeError(f"the {mode} save of step {pending.step} was not committed; see the log above")
            saved_bytes = read_manifest(pending.final)["bytes"]
            shutil.rmtree(pending.final)
        dist.barrier()
        return {
            "stall_s": stall.item(),
            "committed_s": finished_at[0] - pending.started,
            "bytes": saved_bytes,
            "in_flight_steps_s": in_flight_steps,
        }

    saves: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(WARMUP_STEPS):
        train_step(None)
    for _ in range(args.rounds + 1):
        for mode in MODES:
            steps_before = [train_step(None)[0] for _ in range(args.steps_between)]
            saves[mode].append({**measure_save(mode), "steps_before_s": steps_before})
    for checkpointer in checkpointers.values():
        checkpointer.close()
    telemetry.close(5.0)
    if rank == 0:
        Path(args.results).write_text(json.dumps({"params": params, "saves": saves}))
    dist.barrier()
    dist.destroy_process_group()


# The launcher: starts the ranks, then prints what rank 0 measured.


def launch(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="loom-checkpoint-stall-", dir=args.directory) as workdir:
        results = Path(workdir) / "results.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
        command += ["--worker", "--results", str(results), "--directory", workdir]
        command += ["--dim", str(args.dim), "--layers", str(args.layers), "--rounds", str(args.rounds)]
        command += ["--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch)]
        command += ["--steps-between", str(args.steps_between)]
        environ = {key: value for key, value in os.environ.items() if not key.startswith("LOOM_")}
        # One thread per rank: two ranks share the two cores, as comm_overhead.py runs them.
        environ.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        finished = subprocess.run(command, cwd=ROOT, env=environ, capture_output=True, text=True)
        if finished.returncode != 0:
            sys.exit(f"the ranks failed (exit {finished.returncode}):\n{finished.stdout}{finished.stderr}")
        return json.loads(results.read_text())


def report(args: argparse.Namespace, measured: dict, load_before: float, seconds: float) -> None:
    # The first save of each mode is the warm-up: printed, left out of the medians.
    saves = {mode: rows[1:] for mode, rows in measured["saves"].items()}
    print(
        f"model: {measured['params'] / 1e6:.1f} M parameters (dim {args.dim}, {args.layers} layers), fp32, AdamW; "
        f"2 ranks, FSDP dp_shard 2, gloo, CPU; seq_len {args.seq_len}, micro_batch {args.micro_batch}"
    )
    print(f"saves: 1 warm-up + {args.rounds} measured per mode, alternating async, sync")
    for index in range(args.rounds + 1):
        for mode in MODES:
            save = measured["saves"][mode][index]
            name = f"save {index}" if index else "warm-up"
            print(
                f"  {mode:5} {name}: blocked {save['stall_s']:7.3f} s, committed after {save['committed_s']:6.2f} s; "
                f"step before {step_before(save):6.3f} s, steps in flight {steps_text(save['in_flight_steps_s'])}"
            )
    print()
    print(
        f"{'mode':5}  {'blocked':>9}  {'until committed':>15}  {'bytes/save':>10}  {'step before':>11}  "
        f"{'1st step after':>14}  {'extra step time':>15}  {'training lost':>13}"
    )
    lost = {}
    for mode in MODES:
        rows = saves[mode]
        lost[mode] = statistics.median(save["stall_s"] + extra_step_time(save) for save in rows)
        print(
            f"{mode:5}  {median(rows, 'stall_s'):7.3f} s  {median(rows, 'committed_s'):13.2f} s  "
            f"{rows[0]['bytes'] / 1e9:7.2f} GB  {statistics.median(step_before(s) for s in rows):9.3f} s  "
            f"{statistics.median(s['in_flight_steps_s'][0] for s in rows):12.3f} s  "
            f"{statistics.median(extra_step_time(s) for s in rows):13.3f} s  {lost[mode]:11.3f} s"
        )
    print("(medians over the measured saves; blocked: slowest rank; until committed: from save() to rank 0's commit;")
    print(f" step before: median of the {args.steps_between} steps before the save, none in flight; extra step time:")
    print(" the steps taken while the save was in flight, above as many steps before; training lost: blocked + extra)")
    print()
    ratio = median(saves["async"], "stall_s") / median(saves["sync"], "stall_s")
    verdict = "within" if ratio <= 0.05 else "above"
    print(f"async stall / sync save (blocked): {ratio:.3f} (goal ≤ 0.05: {verdict})")
    slowdown = statistics.median(s["in_flight_steps_s"][0] / step_before(s) for s in saves["async"])
    print(f"first step after an async save / step before it: {slowdown:.2f}")
    print(f"training lost per save, async / sync: {lost['async'] / lost['sync']:.3f}")
    print(f"load average (1 min) before {load_before:.2f}, after {os.getloadavg()[0]:.2f}; wall time {seconds:.0f} s")


def step_before(save: dict) -> float:
    return statistics.median(save["steps_before_s"])


def extra_step_time(save: dict) -> float:
    """How much longer the steps beside the save took than as many steps with none in flight."""
    return sum(step - step_before(save) for step in save["in_flight_steps_s"])


def steps_text(steps: list[float]) -> str:
    return ", ".join(f"{step:.3f}" for step in steps) + " s"


def median(rows: list[dict], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"small model: dim, layers = {SIZES['quick']}")
    parser.add_argument("--dim", type=int, help=f"hidden size (default {SIZES['default'][0]})")
    parser.add_argument("--layers", type=int, help=f"transformer blocks (default {SIZES['default'][1]})")
    parser.add_argument("--rounds", type=int, default=3, help="measured saves of each mode, after one warm-up each")
    parser.add_argument("--steps-between", type=int, default=3, help="steps with no save in flight before each save")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--directory", help="where checkpoints are written (default: the system's temporary directory)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    args = parser.parse_args()
    dim, layers = SIZES["quick" if args.quick else "default"]
    args.dim, args.layers = args.dim or dim, args.layers or layers
    if args.worker:
        worker(args)
        return
    args.directory = args.directory or tempfile.gettempdir()
    estimate = approximate_params(model_section(args.dim, args.layers, args.seq_len)) * STATE_BYTES_PER_PARAM
    free = shutil.disk_usage(args.directory).free
    # One checkpoint is on disk at a time; keep room for it twice over and for everything else.
    if free < 2 * estimate + 2e9:
        sys.exit(
            f"{args.directory} has {free / 1e9:.1f} GB free and a save takes about {estimate / 1e9:.1f} GB; "
            f"free {(2 * estimate + 2e9) / 1e9:.1f} GB or pass --directory, --quick or smaller --dim/--layers"
        )
    load_before, started = os.getloadavg()[0], time.perf_counter()
    measured = launch(args)
    report(args, measured, load_before, time.perf_counter() - started)


if __name__ == "__main__":
    main()
