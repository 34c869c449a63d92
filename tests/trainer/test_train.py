import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.config import OptimizerConfig
from trainer.telemetry import read_spool
from trainer.train import (
    STOPPED_EXIT_CODE,
    USAGE_EXIT_CODE,
    LaunchError,
    NonFiniteError,
    learning_rate,
    main,
    select_backend,
    update_allowed,
)

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20
TINY_RUN = {
    "steps": STEPS,
    "model": {"layers": 2, "dim": 64, "heads": 4, "kv_heads": 2, "ffn": 172, "seq_len": 64},
    "parallel": {"dp_replicate": 2},
    "optimizer": {"lr": 3e-3, "warmup_steps": 3},
    "data": {"micro_batch": 8, "corpus_bytes": 300_000},
    "telemetry": {"flush_interval_s": 0.2},
}


def rank_environment(spool_dir: Path, **extra: str) -> dict[str, str]:
    """The test's environment without any platform to report to: telemetry stays in the spool."""
    environ = {key: value for key, value in os.environ.items() if not key.startswith("LOOM_")}
    pythonpath = [str(ROOT), environ.get("PYTHONPATH", "")]
    environ.update(
        LOOM_SPOOL_DIR=str(spool_dir), OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, pythonpath))
    )
    environ.update(extra)
    return environ


def write_config(path: Path, document: dict) -> Path:
    path.write_text(json.dumps(document))
    return path


def events(spool_dir: Path, kind: str) -> list[tuple[int, dict]]:
    spooled = read_spool(spool_dir)
    return [(batch["rank"], event) for batch in spooled for event in batch["events"] if event["kind"] == kind]


@pytest.fixture(scope="module")
def torchrun(tmp_path_factory):
    """One real two-rank run under torchrun, shared by the assertions below."""
    workdir = tmp_path_factory.mktemp("torchrun")
    config = write_config(workdir / "run.json", TINY_RUN)
    spool_dir = workdir / "spool"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += ["-m", "trainer.train", "--config", str(config)]
    result = subprocess.run(
        command, cwd=ROOT, env=rank_environment(spool_dir), capture_output=True, text=True, timeout=180
    )
    return result, spool_dir


@pytest.mark.slow
def test_the_run_exits_cleanly(torchrun):
    result, _ = torchrun
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} step {STEPS}/{STEPS} loss" in result.stdout


@pytest.mark.slow
def test_every_rank_reports_a_metric_for_every_step(torchrun):
    _, spool_dir = torchrun
    metrics = events(spool_dir, "metric")
    for rank in (0, 1):
        steps = [event["step"] for event_rank, event in metrics if event_rank == rank]
        assert steps == list(range(1, STEPS + 1))
    expected = {"loss", "loss_mean", "grad_norm", "lr", "step_time_s", "tokens_per_s", "tokens", "mfu"}
    expected |= {"memory_rss", "memory_peak_rss"}
    # The collective recorder is on by default: the step split into collectives and the rank's own work.
    expected |= {"comm_s", "compute_s"}
    state_bytes = {"parameter_bytes", "gradient_bytes", "optimizer_bytes"}
    for _, event in metrics:
        # Model-state bytes do not change from step to step: the first step reports them once.
        assert set(event["payload"]) == expected | (state_bytes if event["step"] == 1 else set())
    assert all(event["payload"]["mfu"] is None for _, event in metrics), "no peak FLOP/s is known for a CPU"
    assert all(0 < event["payload"]["memory_rss"] <= event["payload"]["memory_peak_rss"] for _, event in metrics)
    for _, event in metrics:
        payload = event["payload"]
        assert payload["comm_s"] > 0 and payload["compute_s"] >= 0
        assert payload["compute_s"] == pytest.approx(max(0.0, payload["step_time_s"] - payload["comm_s"]))
    last = [event["payload"] for _, event in metrics if event["step"] == STEPS]
    assert last[0]["loss_mean"] == pytest.approx(last[1]["loss_mean"])
    assert last[0]["loss_mean"] == pytest.approx((last[0]["loss"] + last[1]["loss"]) / 2, rel=1e-5)
    assert last[0]["grad_norm"] == pytest.approx(last[1]["grad_norm"])
    # tokens counts the whole global batch (2 ranks × 8 sequences of 64); tokens/s each rank's share of it.
    assert all(payload["tokens"] == STEPS * 2 * 8 * 64 for payload in last)


@pytest.mark.slow
def test_the_loss_goes_down(torchrun):
    _, spool_dir = torchrun
    loss_means = [event["payload"]["loss_mean"] for rank, event in events(spool_dir, "metric") if rank == 0]
    first, last = sum(loss_means[:5]) / 5, sum(loss_means[-5:]) / 5
    assert last < first - 0.5, loss_means


@pytest.mark.slow
def test_both_ranks_report_that_they_started_and_finished(torchrun):
    _, spool_dir = torchrun
    states = events(spool_dir, "state")
    for rank in (0, 1):
        payloads = [event["payload"] for event_rank, event in states if event_rank == rank]
        assert [payload["state"] for payload in payloads] == ["started", "finished"]
        started, finished = payloads
        assert started["world_size"] == 2 and started["backend"] == "gloo" and started["device"] == "cpu"
        assert started["params"] > 0
        assert finished["steps"] == STEPS
    logs = [event["payload"] for _, event in events(spool_dir, "log")]
    assert any(log["level"] == "INFO" and log["message"].startswith("training 20 steps") for log in logs)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    config = write_config(tmp_path / "run.json", {**TINY_RUN, "steps": 100_000})
    spool_dir = tmp_path / "spool"
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    ranks = []
    for rank in (0, 1):
        environ = rank_environment(spool_dir, RANK=str(rank), LOCAL_RANK=str(rank), **rendezvous)
        output = (tmp_path / f"rank{rank}.out").open("w")
        command = [sys.executable, "-m", "trainer.train", "--config", str(config)]
        ranks.append(subprocess.Popen(command, cwd=ROOT, env=environ, stdout=output, stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + 120
        while "step 3/" not in (tmp_path / "rank0.out").read_text():
            assert time.monotonic() < deadline and ranks[0].poll() is None, (tmp_path / "rank0.out").read_text()
            time.sleep(0.1)
        ranks[0].send_signal(signal.SIGTERM)
        exit_codes = [process.wait(timeout=30) for process in ranks]
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()

    outputs = [(tmp_path / f"rank{rank}.out").read_text() for rank in (0, 1)]
    assert exit_codes == [STOPPED_EXIT_CODE, STOPPED_EXIT_CODE], outputs
    states = [(rank, event["payload"]) for rank, event in events(spool_dir, "state")]
    stopped = [(rank, payload) for rank, payload in states if payload["state"] != "started"]
    assert sorted(rank for rank, _ in stopped) == [0, 1]
    assert all(payload["state"] == "stopped" and payload["reason"] == "SIGTERM" for _, payload in stopped)
    assert stopped[0][1]["step"] == stopped[1][1]["step"] >= 3


def test_a_world_size_other_than_dp_is_refused_with_the_fix(tmp_path, monkeypatch, capsys):
    config = write_config(tmp_path / "run.json", TINY_RUN)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3"}.items():
        monkeypatch.setenv(name, value)
    assert main(["--config", str(config)]) == USAGE_EXIT_CODE
    assert "--nproc_per_node=2" in capsys.readouterr().err


def test_an_invalid_config_is_refused_with_field_level_errors(tmp_path, capsys):
    config = write_config(tmp_path / "run.json", {"model": {"heads": 3}})
    assert main(["--config", str(config)]) == USAGE_EXIT_CODE
    assert "model.heads: must divide dim=128" in capsys.readouterr().err


def test_the_learning_rate_warms_up_linearly_then_decays_to_its_floor():
    optimizer = OptimizerConfig(lr=1e-3, warmup_steps=4, min_lr_ratio=0.1)
    rates = [learning_rate(step, 20, optimizer) for step in range(1, 21)]
    assert rates[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert all(later < earlier for earlier, later in zip(rates[3:], rates[4:], strict=False))
    assert rates[-1] == pytest.approx(1e-4)
    without_warmup = optimizer.model_copy(update={"warmup_steps": 0})
    assert 0.99e-3 < learning_rate(1, 20, without_warmup) < 1e-3


def test_a_non_finite_gradient_norm_is_skipped_stopped_or_applied_as_configured():
    assert update_allowed("skip", 3, 1.5) and update_allowed("stop", 3, 1.5)
    assert not update_allowed("skip", 3, float("nan"))
    assert update_allowed("continue", 3, float("inf"))
    with pytest.raises(NonFiniteError, match="step 3"):
        update_allowed("stop", 3, float("nan"))


def test_nccl_runs_keep_gloo_for_cpu_tensors():
    # The step's vote is a CPU tensor: under NCCL alone it failed at the first step on a GPU (2026-11-26, H200).
    assert select_backend("auto", cuda_available=True) == "cuda:nccl,cpu:gloo"
    assert select_backend("nccl", cuda_available=True) == "cuda:nccl,cpu:gloo"
    assert select_backend("auto", cuda_available=False) == "gloo"
    assert select_backend("gloo", cuda_available=True) == "gloo"
    with pytest.raises(LaunchError, match="needs CUDA"):
        select_backend("nccl", cuda_available=False)
