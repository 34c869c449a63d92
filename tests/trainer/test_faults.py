"""Injected faults (config.faults) in real two-rank runs: a rank killed, hung or slowed down, a loss gone
NaN, a checkpoint damaged after its commit.

Launches are shared: one run carries both the slow rank and the damaged checkpoint, and the run that
resumes past that checkpoint and the NaN run are the unslowed runs the slow one is measured against."""

import math
import re
import statistics
import time
from pathlib import Path

import pytest
import torch

from loom.alerts.culprits import find_culprits
from trainer.checkpoint import CheckpointCorrupt, verify

from .torchrun import FinishedRun, kill_trainer, run_trainer, start_trainer, started_run_result, wait_for_output

SLOW_MS = 400
FAULT_STEP = 3
# How long a hung run is watched: dozens of this tiny model's steps.
HANG_WATCH_S = 2.0


def document(steps: int, faults: dict, checkpoint: dict | None = None) -> dict:
    return {
        "steps": steps,
        "model": {"layers": 2, "dim": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "seq_len": 32},
        "parallel": {"dp_replicate": 2},
        "compute": {"precision": "fp32"},
        "optimizer": {"lr": 3e-3, "warmup_steps": 1},
        "data": {"micro_batch": 4, "corpus_bytes": 200_000},
        "telemetry": {"flush_interval_s": 0.2, "heartbeat_interval_s": 60, "comm": False},
        "checkpoint": checkpoint or {},
        "faults": faults,
    }


def metrics(run: FinishedRun) -> dict[int, dict[int, dict]]:
    """{rank: {step: payload}} of every spooled metric."""
    by_rank: dict[int, dict[int, dict]] = {}
    for rank, event in run.events("metric"):
        by_rank.setdefault(rank, {})[event["step"]] = event["payload"]
    return by_rank


def checkpoint_events(run: FinishedRun, state: str) -> list[dict]:
    return [event["payload"] for _, event in run.events("checkpoint") if event["payload"]["state"] == state]


def step_times(run: FinishedRun, rank: int) -> list[float]:
    return [payload["step_time_s"] for _, payload in sorted(metrics(run)[rank].items())]


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> FinishedRun:
    return run_trainer(tmp_path_factory.mktemp("killed"), document(5, {"kill_at_step": FAULT_STEP, "kill_rank": 1}))


@pytest.fixture(scope="module")
def slow_and_corrupt(tmp_path_factory) -> tuple[FinishedRun, Path]:
    """Rank 1 sleeps SLOW_MS in every step; checkpoints every 2 steps, and step 4's is damaged once committed."""
    workdir = tmp_path_factory.mktemp("slow_and_corrupt")
    directory = workdir / "checkpoints"
    faults = {"slow_rank": 1, "slow_ms": SLOW_MS, "corrupt_checkpoint_step": 4}
    run = run_trainer(workdir, document(4, faults, {"interval_steps": 2, "directory": str(directory)}))
    assert run.returncode == 0, run.output[-4000:]
    return run, directory


@pytest.fixture(scope="module")
def resumed(slow_and_corrupt, tmp_path_factory) -> FinishedRun:
    """No faults: resumes "latest" from the damaged run's directory (and saves nothing there)."""
    _, directory = slow_and_corrupt
    run = run_trainer(
        tmp_path_factory.mktemp("resumed"), document(4, {}, {"resume": "latest", "directory": str(directory)})
    )
    assert run.returncode == 0, run.output[-4000:]
    return run


@pytest.fixture(scope="module")
def diverged(tmp_path_factory) -> FinishedRun:
    # Applied anyway (optimizer.on_non_finite = continue), as a trainer without the check would.
    config = document(5, {"nan_at_step": FAULT_STEP})
    config["optimizer"]["on_non_finite"] = "continue"
    run = run_trainer(tmp_path_factory.mktemp("diverged"), config)
    assert run.returncode == 0, run.output[-4000:]
    return run


@pytest.mark.slow
def test_a_killed_rank_ends_by_sigkill_before_it_reports_the_step(killed):
    assert killed.returncode != 0
    assert f"injected fault: rank 1 kills itself with SIGKILL at step {FAULT_STEP}" in killed.output
    # torchrun's failure summary, one block per failed rank.
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: -9 \(pid: \d+\)\s+\(SIGKILL\)", killed.output)
    assert f"rank 1 step {FAULT_STEP}/" not in killed.output
    by_rank = metrics(killed)
    assert all(step < FAULT_STEP for step in by_rank.get(1, {})), by_rank.get(1)
    # Rank 0 finished the step before, then lost its peer inside the step's collective.
    assert max(by_rank[0]) == FAULT_STEP - 1


@pytest.mark.slow
def test_a_hung_rank_stops_every_rank_at_its_step_while_its_heartbeats_go_on(tmp_path):
    hung = document(100, {"hang_at_step": FAULT_STEP, "hang_rank": 1})
    hung["telemetry"]["heartbeat_interval_s"] = 0.2
    process = start_trainer(tmp_path, hung)
    try:
        wait_for_output(tmp_path, f"injected fault: rank 1 hangs at step {FAULT_STEP}", process)
        time.sleep(HANG_WATCH_S)
        assert process.poll() is None, "the run ended instead of hanging"
    finally:
        kill_trainer(process)
    run = started_run_result(tmp_path, process)
    printed = [int(step) for step in re.findall(r"rank \d step (\d+)/", run.output)]
    assert max(printed) == FAULT_STEP - 1, run.output[-4000:]
    assert all(step < FAULT_STEP for steps in metrics(run).values() for step in steps)
    (hang_time,) = [event["time"] for _, event in run.events("log") if "hangs at step" in event["payload"]["message"]]
    later_beats = [event for rank, event in run.events("heartbeat") if rank == 1 and event["time"] > hang_time]
    assert len(later_beats) >= 2


@pytest.mark.slow
def test_a_hung_pipeline_stage_is_named_from_its_neighbours_heartbeats(tmp_path):
    """Two pipeline stages; the first hangs before its step's sends. The heartbeats' collective progress,
    judged as the platform judges a stalled run (loom.alerts.culprits), names it: the second stage has
    posted receives from it that it never sent."""
    hung = document(100, {"hang_at_step": FAULT_STEP, "hang_rank": 0})
    hung["parallel"] = {"pp": 2, "microbatches": 2}
    hung["telemetry"] |= {"heartbeat_interval_s": 0.2, "comm": True}
    process = start_trainer(tmp_path, hung)
    try:
        wait_for_output(tmp_path, f"injected fault: rank 0 hangs at step {FAULT_STEP}", process)
        time.sleep(HANG_WATCH_S)
    finally:
        kill_trainer(process)
    run = started_run_result(tmp_path, process)
    beats = run.events("heartbeat")
    progress = {rank: event["payload"]["collectives"] for rank, event in beats if "collectives" in event["payload"]}
    verdict = find_culprits(progress, settle_s=HANG_WATCH_S / 2)
    assert [suspect.rank for suspect in verdict.culprits] == [0], progress
    assert verdict.culprits[0].evidence[0].startswith("it sent rank 1 ")
    assert not verdict.culprits[0].waiting and "recv" in verdict.waits[1]


@pytest.mark.slow
def test_a_slow_rank_sleeps_in_every_timed_step_and_the_other_waits_for_it(slow_and_corrupt, resumed, diverged):
    run, _ = slow_and_corrupt
    slow_s = SLOW_MS / 1000
    # The same model and layout without a slow rank, measured in this session.
    unslowed = [seconds for other in (resumed, diverged) for rank in (0, 1) for seconds in step_times(other, rank)]
    assert statistics.median(unslowed) < slow_s, unslowed
    assert all(seconds >= slow_s for seconds in step_times(run, 1)), step_times(run, 1)
    # Rank 0 starts each step with rank 1 (the previous step's collective lines them up) and then waits
    # for its gradients; a tenth leaves room for the ranks' bookkeeping between steps to differ.
    assert all(seconds >= 0.9 * slow_s for seconds in step_times(run, 0)), step_times(run, 0)


@pytest.mark.slow
def test_a_nan_step_reports_nan_on_every_rank_and_the_parameters_diverge(diverged):
    by_rank = metrics(diverged)
    for rank in (0, 1):
        payloads = by_rank[rank]
        assert sorted(payloads) == [1, 2, 3, 4, 5]
        for step in range(1, FAULT_STEP):
            assert math.isfinite(payloads[step]["loss_mean"]) and math.isfinite(payloads[step]["loss"])
        for step in range(FAULT_STEP, 6):
            assert math.isnan(float(payloads[step]["loss_mean"])) and math.isnan(float(payloads[step]["loss"]))
        assert math.isnan(float(payloads[FAULT_STEP]["grad_norm"]))
    parameters = diverged.parameters()
    assert parameters and all(torch.isnan(tensor).all() for tensor in parameters.values())


@pytest.mark.slow
def test_a_nan_metric_is_spooled_as_the_string_nan_that_float_reads_back(diverged):
    """Bare NaN is not JSON (the platform's database refuses it); telemetry writes the string instead."""
    payload = metrics(diverged)[0][FAULT_STEP]
    assert payload["loss_mean"] == "NaN" and payload["loss"] == "NaN" and payload["grad_norm"] == "NaN"


@pytest.mark.slow
def test_a_checkpoint_damaged_after_its_commit_is_named_and_skipped_by_latest(slow_and_corrupt, resumed):
    run, directory = slow_and_corrupt
    messages = [event["payload"]["message"] for _, event in run.events("log")]
    (warning,) = [message for message in messages if "flipped one byte" in message]
    damaged = Path(re.search(r"flipped one byte of (\S+\.distcp)", warning)[1])
    assert damaged.parent == directory / "step-000004"
    assert [event["step"] for event in checkpoint_events(run, "committed")] == [2, 4]
    assert {event["payload"]["state"] for _, event in run.events("checkpoint")} == {"committed"}
    with pytest.raises(CheckpointCorrupt, match=f"step-000004/{damaged.name}: sha256 mismatch"):
        verify(directory / "step-000004")
    verify(directory / "step-000002")

    (corrupt,) = checkpoint_events(resumed, "corrupt")
    assert corrupt["step"] == 4 and corrupt["error"] == f"step-000004/{damaged.name}: sha256 mismatch"
    (loaded,) = checkpoint_events(resumed, "loaded")
    assert loaded["step"] == 2 and loaded["path"] == str(directory / "step-000002")
    assert sorted(metrics(resumed)[0]) == [3, 4]
