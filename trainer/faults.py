"""Failures injected on purpose (config.faults), so recovery paths are exercised by real runs."""

from trainer.config import FaultsConfig


class InjectedFault(RuntimeError):
    pass


def before_step(faults: FaultsConfig, step: int, rank: int) -> None:
    if faults.crash_at_step == step and faults.crash_rank == rank:
        raise InjectedFault(f"injected fault: rank {rank} crashes at step {step} (faults.crash_at_step)")
