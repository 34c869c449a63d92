"""Which batch a step trains on, a pure function of (seed, step), and which validation sequences a rank
evaluates: a restarted run, or the same run in another layout, reads exactly the same data."""

from __future__ import annotations

import hashlib

import numpy as np


def data_step(step: int, skip_steps: list[tuple[int, int]]) -> int:
    """The step whose batch `step` trains on: later by the length of every skipped range it has reached."""
    index = step
    for first, last in sorted(skip_steps):
        if index >= first:
            index += last - first + 1
    return index


def batch_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed that is the same in every process (unlike hash())."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class DataMismatch(RuntimeError):
    """A checkpoint written training on other data than the run's config names."""


def validation_sequences(batches: int, micro_batch: int, dp_rank: int, dp_size: int, count: int) -> list[np.ndarray]:
    """The validation sequence numbers this rank evaluates, per batch: batch b is sequences
    [b·micro_batch·dp_size, (b + 1)·micro_batch·dp_size) in order, rank r its r-th micro_batch of them, wrapping
    around a split of `count` sequences. The same every time, in every layout."""
    per_batch = micro_batch * dp_size
    return [
        np.arange(first, first + micro_batch, dtype=np.int64) % count
        for first in (index * per_batch + dp_rank * micro_batch for index in range(batches))
    ]
