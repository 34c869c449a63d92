"""Which batch a step trains on: a pure function of (seed, step), so a restarted run, or the same run in
another layout, reads exactly the same data."""

from __future__ import annotations

import hashlib


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
