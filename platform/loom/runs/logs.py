"""Reading what ranks printed, as torchrun captured it under an attempt's work dir."""

import json
import os
from dataclasses import dataclass
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


@dataclass(frozen=True)
class RankFailure:
    rank: int
    message: str
    traceback: str


def first_failure(work_dir: Path) -> RankFailure | None:
    """The rank that failed first, from the error.json torchrun writes for each failed rank.

    Once one rank dies the others fail in their next collective; the earliest error is the cause.
    Timestamps are whole seconds, so the file's own modification time breaks ties."""
    failures = []
    for path in Path(work_dir).glob("logs/*/attempt_*/*/error.json"):
        try:
            error = json.loads(path.read_text())["message"]
            when = (int(error["extraInfo"]["timestamp"]), path.stat().st_mtime_ns)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        failure = RankFailure(int(path.parent.name), error["message"], error["extraInfo"].get("py_callstack", ""))
        failures.append((when, failure))
    return min(failures, key=lambda item: item[0])[1] if failures else None
