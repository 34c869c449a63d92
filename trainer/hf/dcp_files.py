"""DCP on one process, without a process group: how import writes and export reads checkpoints."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def single_process() -> Iterator[None]:
    """Runs dcp.save/dcp.load with no_dist=True quietly: without a process group is the intent, not a mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
