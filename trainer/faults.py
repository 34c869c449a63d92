"""Failures injected on purpose (config.faults), so recovery paths are exercised by real runs."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from trainer.config import FaultsConfig

# A hung rank wakes this often only to go back to sleep; whoever ends it sends a signal.
HANG_SLEEP_S = 60.0

logger = logging.getLogger("trainer.faults")


class InjectedFault(RuntimeError):
    pass


def before_step(faults: FaultsConfig, step: int, rank: int, settle: Callable[[], None]) -> None:
    """The faults that strike as a step starts, before any of its collectives. `settle` waits for the
    checkpoint writes in flight, so what a kill leaves behind does not depend on timing."""
    crash(faults, step, rank)
    kill(faults, step, rank, settle)
    hang(faults, step, rank)


def crash(faults: FaultsConfig, step: int, rank: int) -> None:
    if faults.crash_at_step == step and faults.crash_rank == rank:
        raise InjectedFault(f"injected fault: rank {rank} crashes at step {step} (faults.crash_at_step)")


def kill(faults: FaultsConfig, step: int, rank: int, settle: Callable[[], None]) -> None:
    """SIGKILL cannot be caught: no handler, no cleanup and no last telemetry, as when the kernel or a
    node failure ends a process. A checkpoint save still being written first finishes writing: a real
    crash may land before or after it, and a rehearsal must land at the same place every time."""
    if faults.kill_at_step == step and faults.kill_rank == rank:
        settle()
        logger.warning("injected fault: rank %d kills itself with SIGKILL at step %d (faults.kill_at_step)", rank, step)
        os.kill(os.getpid(), signal.SIGKILL)


def hang(faults: FaultsConfig, step: int, rank: int) -> None:
    """Never returns. SIGTERM only sets the stop flag the step loop would read, so like a rank stuck in a
    collective this one ends only by SIGKILL; the telemetry threads keep sending heartbeats."""
    if faults.hang_at_step == step and faults.hang_rank == rank:
        logger.warning("injected fault: rank %d hangs at step %d (faults.hang_at_step)", rank, step)
        while True:
            time.sleep(HANG_SLEEP_S)


def slow_down(faults: FaultsConfig, step: int, rank: int) -> None:
    """Called inside the timed part of every step, so the slow rank's step time shows it and the other
    ranks wait for it in the step's collectives."""
    if faults.slow_rank == rank and faults.slow_ms > 0 and step >= faults.slow_from_step:
        time.sleep(faults.slow_ms / 1000)


def spike(
    faults: FaultsConfig, step: int, loss: torch.Tensor | None, parameters: list[torch.nn.Parameter]
) -> torch.Tensor | None:
    """At faults.spike_at_step, the loss and every gradient times spike_factor: what backward would have
    given for the loss of a batch spike_factor times worse."""
    if faults.spike_at_step != step:
        return loss
    with torch.no_grad():
        for parameter in parameters:
            if parameter.grad is not None:
                local(parameter.grad).mul_(faults.spike_factor)
        return loss * faults.spike_factor if loss is not None else None


class Leak:
    """faults.leak_mb_per_step more memory kept alive after every step, until the process ends."""

    def __init__(self, faults: FaultsConfig):
        self._bytes = int(faults.leak_mb_per_step * 2**20)
        self._kept: list[bytearray] = []

    def step_done(self) -> None:
        if self._bytes:
            # Written, not just reserved: resident memory is what a rank reports on CPU.
            self._kept.append(bytearray(b"\x01" * self._bytes))


def diverge(
    faults: FaultsConfig, step: int, loss: torch.Tensor | None, parameters: list[torch.nn.Parameter]
) -> torch.Tensor | None:
    """The step's loss, or NaN at faults.nan_at_step. Then every gradient is NaN too, so the global gradient
    norm is, as after a real loss spike (what the update then does is optimizer.on_non_finite's). Every rank
    poisons its own gradients: each holds shards or stages no other rank does."""
    if faults.nan_at_step != step:
        return loss
    with torch.no_grad():
        for parameter in parameters:
            if parameter.grad is not None:
                local(parameter.grad).fill_(float("nan"))
        return loss * float("nan") if loss is not None else None


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def corrupt_checkpoint(faults: FaultsConfig, step: int, directory: Path) -> None:
    """Rank 0, once the checkpoint of faults.corrupt_checkpoint_step is committed: flip one byte in the
    middle of one data file, which only a later load's verification notices."""
    if faults.corrupt_checkpoint_step != step:
        return
    shard = sorted(directory.glob("*.distcp"))[0]
    with shard.open("r+b") as file:
        file.seek(shard.stat().st_size // 2)
        byte = file.read(1)[0]
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte ^ 0xFF]))
    logger.warning("injected fault: flipped one byte of %s (faults.corrupt_checkpoint_step)", shard)
