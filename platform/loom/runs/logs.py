"""Reading what ranks printed, as torchrun captured it under an attempt's work dir."""

import os
from pathlib import Path


def rank_log_files(work_dir: Path, rank: int) -> list[Path]:
    """torchrun's --log-dir layout: logs/<rdzv id>/attempt_<n>/<local rank>/{stdout,stderr}.log."""
    logs = Path(work_dir) / "logs"
    return sorted(logs.glob(f"*/attempt_*/{rank}/stdout.log")) + sorted(logs.glob(f"*/attempt_*/{rank}/stderr.log"))


def tail_lines(path: Path, count: int) -> list[str]:
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        size = handle.tell()
        handle.seek(max(0, size - 64 * 1024))
        return handle.read().decode("utf-8", "replace").splitlines()[-count:]
