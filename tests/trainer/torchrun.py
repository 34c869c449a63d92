"""Launching the trainer under a real torchrun, for tests that need whole runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.config import parse_config
from trainer.telemetry import read_spool
from trainer.traffic import traffic_matrix

ROOT = Path(__file__).resolve().parents[2]
# How much of torchrun's output, and of each rank's stdout and stderr, a failure report shows.
REPORT_LINES = 40


@dataclass
class FinishedRun:
    returncode: int
    output: str
    spool_dir: Path
    params_dir: Path
    rank_logs_dir: Path | None = None

    def failure_report(self) -> str:
        """The end of torchrun's output, then the end of each rank's own stdout and stderr. In the
        combined output the ranks interleave and the last lines are the survivors' errors, so the
        last words of the rank that failed first (a faulthandler stack, say) scroll out of sight."""
        parts = [f"torchrun exited with {self.returncode}; its output ends:", _last_lines(self.output)]
        logs = self.rank_logs_dir.glob("*/attempt_0/*/std*.log") if self.rank_logs_dir else []
        for path in sorted(logs, key=lambda path: (int(path.parent.name), path.name)):
            parts += [f"---- rank {path.parent.name} {path.stem} ends:", _last_lines(path.read_text(errors="replace"))]
        return "\n".join(parts)

    def events(self, kind: str) -> list[tuple[int, dict]]:
        """(rank, event) for every spooled event of this kind, by rank then seq."""
        return [
            (batch["rank"], event)
            for batch in read_spool(self.spool_dir)
            for event in batch["events"]
            if event["kind"] == kind
        ]

    def rank0_metrics(self) -> list[dict]:
        """Rank 0's metric payloads, one per step, in step order."""
        metrics = [
            event
            for batch in read_spool(self.spool_dir)
            if batch["rank"] == 0
            for event in batch["events"]
            if event["kind"] == "metric"
        ]
        return [event["payload"] for event in sorted(metrics, key=lambda event: event["step"])]

    def grad_norms(self) -> list[float]:
        """The global gradient norm of every step, as rank 0 reported it."""
        return [payload["grad_norm"] for payload in self.rank0_metrics()]

    def loss_means(self) -> list[float]:
        """The all-rank loss mean of every step, as rank 0 reported it."""
        return [payload["loss_mean"] for payload in self.rank0_metrics()]

    def eval_losses(self) -> dict[int, dict[int, float]]:
        """{rank: {step: eval_loss}} over every metric event that carries one."""
        found: dict[int, dict[int, float]] = {}
        for rank, event in self.events("metric"):
            if "eval_loss" in event["payload"]:
                found.setdefault(rank, {})[event["step"]] = event["payload"]["eval_loss"]
        return found

    def traffic_per_step(self, kinds: tuple[str, ...], after_step: int, steps: int) -> dict[str, list[list[float]]]:
        """{kind: bytes each rank sent each other per step} over steps after_step + 1 … steps, from the comm
        events of a run that reports every step's traffic (telemetry.comm_window_steps 1)."""
        rows = [event["payload"] for _, event in self.events("comm") if event["payload"]["window"][0] > after_step]
        counted = steps - after_step
        matrix = traffic_matrix(rows).by_kind
        return {kind: [[nbytes / counted for nbytes in row] for row in matrix[kind]] for kind in kinds}

    def parameters(self) -> dict[str, torch.Tensor]:
        """The final full parameters, merged from every pipeline rank's file."""
        merged: dict[str, torch.Tensor] = {}
        for path in sorted(self.params_dir.glob("pp-*.pt")):
            merged.update(torch.load(path))
        return merged


def assert_trains_like(run: FinishedRun, reference: FinishedRun) -> None:
    """The run's per-step loss means within 1e-5 (relative) of the reference's, and the same final parameters.

    Sums in another order differ in the last bits, and Adam divides by sqrt(v): on entries whose gradient is near
    zero that noise becomes an update of ~1e-5, and on the rare entry whose gradient is all noise (a GELU unit that
    hardly fires) of ~1e-4. A layout bug (a missing reduction, a wrong shard) moves the parameters it touches by
    the learning rate, 3e-3: every entry must be within a third of that, all but 0.1 % of them within 1e-4, and
    those together within 2e-4 of the tensor's norm (the interpreted Triton kernels on tensor-parallel shards come
    to 1.01e-4 on some CPUs; a layout bug to several percent)."""
    expected, actual = reference.loss_means(), run.loss_means()
    assert len(actual) == len(expected)
    for step, (want, got) in enumerate(zip(expected, actual, strict=True), start=1):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} vs {want}"
    # Adam all but hides a gradient scaled by a constant; the gradient's norm shows it.
    for step, (want, got) in enumerate(zip(reference.grad_norms(), run.grad_norms(), strict=True), start=1):
        assert abs(got - want) <= 1e-4 * want, f"step {step}: gradient norm {got} vs {want}"
    wanted, parameters = reference.parameters(), run.parameters()
    assert sorted(parameters) == sorted(wanted)
    for name, tensor in wanted.items():
        difference = (parameters[name] - tensor).abs()
        assert difference.max() <= 1e-3, name
        noise = difference > 1e-4
        assert noise.sum() <= difference.numel() // 1000, name
        assert difference[~noise].norm() <= 2e-4 * tensor.norm(), name


def _last_lines(text: str) -> str:
    return "\n".join(text.splitlines()[-REPORT_LINES:])


def trainer_launch(
    workdir: Path, document: dict, extra_env: dict[str, str] | None = None, rank_logs_dir: Path | None = None
) -> tuple[list[str], dict]:
    """The torchrun command line and environment for the config, written to workdir/run.json; offline
    (no LOOM_ variable from the caller's environment leaks in, only those in extra_env). With
    rank_logs_dir, torchrun also writes each rank's stdout and stderr to files of their own there
    (its console lines then start with the rank, e.g. "[default3]:")."""
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "run.json"
    config_path.write_text(json.dumps(document))
    world_size = parse_config(document).parallel.world_size
    environ = {key: value for key, value in os.environ.items() if not key.startswith("LOOM_")}
    environ.update(
        LOOM_SPOOL_DIR=str(workdir / "spool"),
        LOOM_DUMP_PARAMS_DIR=str(workdir / "params"),
        OMP_NUM_THREADS="1",
        # A rank that dies by a signal (SIGABRT, SIGSEGV) prints every thread's Python stack first.
        PYTHONFAULTHANDLER="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), environ.get("PYTHONPATH", "")])),
    )
    environ.update(extra_env or {})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}"]
    if rank_logs_dir is not None:
        command += ["--log-dir", str(rank_logs_dir), "--tee", "3"]
    command += ["-m", "trainer.train", "--config", str(config_path)]
    return command, environ


def run_trainer(
    workdir: Path, document: dict, timeout_s: float = 300, extra_env: dict[str, str] | None = None
) -> FinishedRun:
    """Run the config offline (telemetry stays spooled) on as many ranks as its layout needs; each rank's
    output is also kept on its own, for failure_report()."""
    workdir.mkdir(parents=True, exist_ok=True)
    # A directory per launch: some tests launch twice in one workdir.
    rank_logs_dir = Path(tempfile.mkdtemp(prefix="ranks-", dir=workdir))
    command, environ = trainer_launch(workdir, document, extra_env, rank_logs_dir)
    result = subprocess.run(
        command, cwd=ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s
    )
    return FinishedRun(result.returncode, result.stdout, workdir / "spool", workdir / "params", rank_logs_dir)


def start_trainer(workdir: Path, document: dict) -> subprocess.Popen:
    """Start the run like the platform's launcher does, in a session of its own; its output goes to
    workdir/output.log. torchrun passes a SIGTERM to its group on to the ranks, but starts each rank
    in a session of its own, so only kill_trainer reaches them with SIGKILL."""
    command, environ = trainer_launch(workdir, document)
    with (workdir / "output.log").open("w") as output:
        return subprocess.Popen(
            command, cwd=ROOT, env=environ, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )


def started_run_result(workdir: Path, process: subprocess.Popen) -> FinishedRun:
    """What a run from start_trainer left behind, once its process has ended."""
    return FinishedRun(process.wait(), (workdir / "output.log").read_text(), workdir / "spool", workdir / "params")


def wait_for_output(workdir: Path, text: str, process: subprocess.Popen, timeout_s: float = 120) -> None:
    """Wait until a run from start_trainer has printed text; fails if it ends or times out first."""
    deadline = time.monotonic() + timeout_s
    output = workdir / "output.log"
    while text not in output.read_text():
        assert process.poll() is None and time.monotonic() < deadline, output.read_text()[-4000:]
        time.sleep(0.1)


def kill_trainer(process: subprocess.Popen) -> None:
    """SIGKILL a run from start_trainer: its ranks first (killed, torchrun cannot pass the signal on),
    then torchrun's group."""
    for pid in child_pids(process.pid):
        os.kill(pid, signal.SIGKILL)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def child_pids(parent: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name in parentheses may hold spaces; the parent pid is the second field after it.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            children.append(int(stat.parent.name))
    return children
