"""Reading what ranks printed, as torchrun captured it under an attempt's work dir.

One torchrun (the local backend) writes logs/launcher.log and logs/<rdzv id>/attempt_<k>/<local rank>/.
Under a multi-node backend each node's torchrun writes the same under logs/<node>/, beside a node.json
saying the first global rank it ran: torchrun names per-rank directories by local rank, so a global rank
is that node's first rank plus the local rank."""

import json
import os
from dataclasses import dataclass
from pathlib import Path

from trainer.telemetry import set_aside_count

# Where an attempt's ranks (LOOM_SPOOL_DIR) and its launcher spool the telemetry they have not delivered yet.
SPOOL_DIRS = ("spool", "launcher-spool")


@dataclass(frozen=True)
class NodeLogs:
    """Where one torchrun wrote, and the global rank of its local rank 0."""

    directory: Path
    first_rank: int
    node: str = ""

    @property
    def launcher_log(self) -> Path:
        return self.directory / "launcher.log"


def node_logs(work_dir: Path) -> list[NodeLogs]:
    """Each node's torchrun output in the attempt's work dir, by first rank; the single torchrun's when
    no node has said which ranks it ran."""
    logs = Path(work_dir) / "logs"
    nodes = []
    for path in logs.glob("*/node.json"):
        try:
            info = json.loads(path.read_text())
            nodes.append(NodeLogs(path.parent, int(info["first_rank"]), str(info.get("node", path.parent.name))))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(nodes, key=lambda node: node.first_rank) or [NodeLogs(logs, 0)]


def rank_files(node: NodeLogs, rank: int, name: str) -> list[Path]:
    local_rank = rank - node.first_rank
    return sorted(node.directory.glob(f"*/attempt_*/{local_rank}/{name}")) if local_rank >= 0 else []


def rank_log_files(work_dir: Path, rank: int) -> list[Path]:
    """The global rank's stdout.log files, then its stderr.log files (one per torchrun restart)."""
    nodes = node_logs(work_dir)
    return [path for name in ("stdout.log", "stderr.log") for node in nodes for path in rank_files(node, rank, name)]


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
    for node in node_logs(work_dir):
        for path in node.directory.glob("*/attempt_*/*/error.json"):
            try:
                error = json.loads(path.read_text())["message"]
                when = (int(error["extraInfo"]["timestamp"]), path.stat().st_mtime_ns)
                rank = node.first_rank + int(path.parent.name)
            except (OSError, ValueError, KeyError, TypeError):
                continue
            failures.append((when, RankFailure(rank, error["message"], error["extraInfo"].get("py_callstack", ""))))
    return min(failures, key=lambda item: item[0])[1] if failures else None


def batches_set_aside(work_dir: str) -> int:
    """How many telemetry batches of the attempt the platform refused for good: its ranks and its launcher keep
    each in their spool's rejected/ folder (the reason is in that rank's log), not lost and not retried."""
    if not work_dir:
        return 0
    return sum(set_aside_count(Path(work_dir) / name) for name in SPOOL_DIRS)
