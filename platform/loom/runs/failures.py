"""Why an attempt failed, and whether running it again could help.

Restarting pays off when the cause was outside the program (a rank killed, a peer lost, the
supervising worker gone) and never when the program itself would fail the same way again (out of
memory, an invalid config, a Python exception in the training code) — the rule Determined's log
policies encode with patterns over the logs. The evidence is what torchrun leaves behind: its
failure summary in the launcher's log (every failed rank with its exit code or signal) and each
rank's error.json.
"""

import re
import signal
from dataclasses import dataclass
from pathlib import Path

from .logs import first_failure, node_logs, rank_log_files, tail_lines

KILLED = "killed"
SEGFAULT = "segfault"
LOST_PEER = "lost_peer"
COLLECTIVE_TIMEOUT = "collective_timeout"
GPU_ERROR = "gpu_error"
WORKER_LOST = "worker_lost"
OUT_OF_MEMORY = "out_of_memory"
INVALID_CONFIG = "invalid_config"
EXCEPTION = "exception"
UNKNOWN = "unknown"
LAUNCH_ERROR = "launch_error"
# What the launch backend, not the program, ended (backends.Observation.backend_failure): a node that went down
# or lost its link, a job the scheduler preempted for another or stopped at its time limit. Each is worth
# another try from the last checkpoint, on other nodes where the scheduler can choose.
NODE_FAILURE = "node_failure"
PREEMPTED = "preempted"
TIME_LIMIT = "timeout"

# A GPU that raised an Xid or ECC error, a collective that timed out and a crash in native code are as
# likely the machine's fault as the program's: another try (on other hardware, when the scheduler can
# choose) may well work, and max_restarts bounds the cost if it does not.
RETRYABLE = frozenset(
    {
        KILLED,
        SEGFAULT,
        LOST_PEER,
        COLLECTIVE_TIMEOUT,
        GPU_ERROR,
        WORKER_LOST,
        UNKNOWN,
        NODE_FAILURE,
        PREEMPTED,
        TIME_LIMIT,
    }
)

# The trainer's exit code for a config or launch it refuses before training (trainer.train.USAGE_EXIT_CODE).
USAGE_EXIT_CODE = 2
SUMMARY_LINES = 400
FAILURE_TAIL_LINES = 30

# torchrun's summary: "  rank      : 1 (local_rank: 1)" then "  exitcode  : -9 (pid: 6936)  (SIGKILL)".
SUMMARY_ENTRY = re.compile(r"^\s*rank\s*:\s*(\d+).*\n\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)
OUT_OF_MEMORY_PATTERNS = re.compile(r"OutOfMemoryError|out of memory|CUBLAS_STATUS_ALLOC_FAILED", re.IGNORECASE)
GPU_ERROR_PATTERNS = re.compile(
    r"CUDA error|cudaError|Xid|ECC error|uncorrectable ECC|illegal memory access|CUDA_ERROR_|"
    r"device-side assert|GPU is lost|fallen off the bus",
    re.IGNORECASE,
)
COLLECTIVE_TIMEOUT_PATTERNS = re.compile(
    r"Watchdog caught collective operation timeout|collective operation timeout|ProcessGroupNCCL.*timed? ?out|"
    r"\[gloo\].*Timed out|Timed out waiting .* for (send|recv)|Socket Timeout|NCCL.*timeout",
    re.IGNORECASE,
)
SEGFAULT_PATTERNS = re.compile(r"Segmentation fault|SIGSEGV|Fatal Python error: Segmentation", re.IGNORECASE)
LOST_PEER_PATTERNS = re.compile(
    r"DistBackendError|Connection closed by peer|Connection reset by peer|NCCL (error|communicator)|Broken pipe",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Failure:
    kind: str
    reason: str
    rank: int | None = None

    @property
    def retryable(self) -> bool:
        return self.kind in RETRYABLE


def rank_exit_codes(launcher_log: Path) -> dict[int, int]:
    """Each failed rank's exit code from torchrun's failure summary; a negative code is the signal."""
    if not launcher_log.exists():
        return {}
    text = "\n".join(tail_lines(launcher_log, SUMMARY_LINES))
    return {int(rank): int(code) for rank, code in SUMMARY_ENTRY.findall(text)}


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def classify(work_dir: Path, worker_lost: bool = False) -> Failure:
    """The failure of a torchrun that ended badly, from what it left in work_dir: the exit codes of its
    summary, the first failed rank's error.json, and the tail of the implicated rank's own log."""
    if worker_lost:
        return Failure(WORKER_LOST, "the worker supervising this attempt shut down")
    launcher_logs = [node.launcher_log for node in node_logs(work_dir)]
    # Each node's summary names global ranks, so the nodes' codes never collide.
    codes = {rank: code for launcher_log in launcher_logs for rank, code in rank_exit_codes(launcher_log).items()}
    # torchrun stops the surviving ranks with SIGTERM once one fails; those are not the cause.
    killed = {rank: -code for rank, code in codes.items() if code < 0 and -code != signal.SIGTERM}
    if killed:
        rank = min(killed)
        tail = rank_log_tail(work_dir, rank)
        if killed[rank] == signal.SIGSEGV or SEGFAULT_PATTERNS.search(tail):
            return Failure(
                SEGFAULT, f"rank {rank} crashed with a segmentation fault ({signal_name(killed[rank])})\n{tail}", rank
            )
        if GPU_ERROR_PATTERNS.search(tail):
            return Failure(
                GPU_ERROR, f"rank {rank} was killed by {signal_name(killed[rank])} after a GPU error\n{tail}", rank
            )
        return Failure(KILLED, f"rank {rank} was killed by {signal_name(killed[rank])}", rank)
    failure = first_failure(work_dir)
    if failure is not None:
        detail = f"rank {failure.rank} failed first: {failure.message}\n" + "\n".join(
            failure.traceback.splitlines()[-FAILURE_TAIL_LINES:]
        )
        text = f"{failure.message}\n{failure.traceback}\n{rank_log_tail(work_dir, failure.rank)}"
        for kind, patterns in (
            (OUT_OF_MEMORY, OUT_OF_MEMORY_PATTERNS),
            (GPU_ERROR, GPU_ERROR_PATTERNS),
            (COLLECTIVE_TIMEOUT, COLLECTIVE_TIMEOUT_PATTERNS),
            (LOST_PEER, LOST_PEER_PATTERNS),
        ):
            if patterns.search(text):
                return Failure(kind, detail, failure.rank)
        return Failure(EXCEPTION, detail, failure.rank)
    tail = launcher_tails(launcher_logs)
    if USAGE_EXIT_CODE in codes.values():
        return Failure(INVALID_CONFIG, f"the trainer refused its config or launch\n{tail}")
    return Failure(UNKNOWN, tail)


def launcher_tails(launcher_logs: list[Path]) -> str:
    """The end of every node's launcher log, each under its node's name when there are several."""
    tails = []
    for launcher_log in launcher_logs:
        if launcher_log.exists():
            heading = [f"== {launcher_log.parent.name} =="] if len(launcher_logs) > 1 else []
            tails.append("\n".join(heading + tail_lines(launcher_log, FAILURE_TAIL_LINES)))
    return "\n".join(tails)


def rank_log_tail(work_dir: Path, rank: int) -> str:
    """The last lines the rank wrote to stderr (where Python's fatal errors and NCCL's warnings go)."""
    stderr = [path for path in rank_log_files(work_dir, rank) if path.name == "stderr.log"]
    return "\n".join(tail_lines(stderr[-1], FAILURE_TAIL_LINES)) if stderr else ""
