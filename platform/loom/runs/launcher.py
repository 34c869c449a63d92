"""Launch an attempt as a torchrun process group and supervise it until it ends.

The launcher reports every state change through the ingest API as rank -1, the same path the
ranks use, so the browser learns about it the one way it learns about everything.
"""

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from celery.signals import worker_shutting_down
from django.conf import settings

from loom.accounts.tokens import hash_token, mint_token
from trainer.config import world_size_of
from trainer.telemetry import TelemetryClient, deliver_spool

from . import states
from .failures import LAUNCH_ERROR, Failure, classify
from .models import Attempt
from .services import mirror_on_run, move_attempt

log = logging.getLogger(__name__)

LAUNCHER_RANK = -1
DELIVERY_DEADLINE_S = 120.0
# Indexes into stat_fields(): /proc/<pid>/stat fields 4 (parent pid) and 22 (start time), counted from 3.
PARENT_FIELD = 1
START_TIME_FIELD = 19

# Set when this worker process is shutting down: supervised attempts are stopped, not orphaned.
_shutting_down = threading.Event()


@worker_shutting_down.connect
def _stop_supervising(**_):
    _shutting_down.set()


def claim_attempt(attempt_id: int) -> tuple[Attempt, str] | None:
    """Atomically move a queued attempt to starting and mint its token; None if already taken."""
    token = mint_token("attempt")
    claimed = Attempt.objects.filter(pk=attempt_id, state=states.QUEUED, token_hash="").update(
        state=states.STARTING, token_hash=hash_token(token)
    )
    if not claimed:
        return None
    attempt = Attempt.objects.select_related("run").get(pk=attempt_id)
    mirror_on_run(attempt)
    return attempt, token


def work_dir_for(attempt: Attempt) -> Path:
    return Path(settings.LOOM_RUNS_DIR) / f"run-{attempt.run_id}" / f"attempt-{attempt.number}"


def launch(attempt_id: int) -> str:
    claimed = claim_attempt(attempt_id)
    if claimed is None:
        log.info("attempt %s is not queued any more; this delivery does nothing", attempt_id)
        return "skipped"
    attempt, token = claimed
    work_dir = work_dir_for(attempt)
    (work_dir / "logs").mkdir(parents=True, exist_ok=True)
    Attempt.objects.filter(pk=attempt.pk).update(work_dir=str(work_dir))
    reporter = TelemetryClient(
        url=settings.LOOM_INGEST_URL,
        token=token,
        attempt=attempt.pk,
        rank=LAUNCHER_RANK,
        spool_dir=work_dir / "launcher-spool",
        flush_interval_s=0.1,
        heartbeat_interval_s=None,
    )
    reporter.emit("state", {"attempt": attempt.number, "state": states.STARTING})
    try:
        process = _spawn(attempt, token, work_dir)
    except OSError as error:
        failure = Failure(LAUNCH_ERROR, f"could not start torchrun: {error}")
        return _finish(reporter, attempt, work_dir, token, states.FAILED, None, failure)
    reporter.emit("state", {"attempt": attempt.number, "state": states.RUNNING, "pid": process.pid})
    exit_code, stopped_by = _supervise(process, attempt.pk)
    outcome, failure = _outcome(exit_code, stopped_by, work_dir)
    return _finish(reporter, attempt, work_dir, token, outcome, exit_code, failure)


def checkpoint_dir_for(work_dir: Path) -> Path:
    """Each attempt writes its own checkpoints, so a restore from an earlier step never overwrites or
    retires another attempt's; the config's checkpoint.directory, when set, still wins."""
    return work_dir / "checkpoints"


def _spawn(attempt: Attempt, token: str, work_dir: Path) -> subprocess.Popen:
    config_path = work_dir / "config.json"
    config_path.write_text(json.dumps(attempt.config, indent=2))
    world_size = world_size_of(attempt.config)
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", f"--nproc_per_node={world_size}",
        "--log-dir", str(work_dir / "logs"), "--redirects", "3",
        "-m", "trainer.train", "--config", str(config_path),
    ]  # fmt: skip
    env = {
        **os.environ,
        # The trainer's LOOM_URL is where it sends telemetry.
        "LOOM_URL": settings.LOOM_INGEST_URL,
        "LOOM_TOKEN": token,
        "LOOM_ATTEMPT": str(attempt.pk),
        "LOOM_SPOOL_DIR": str(work_dir / "spool"),
        "LOOM_RUN_ID": str(attempt.run_id),
        "LOOM_CHECKPOINT_DIR": str(checkpoint_dir_for(work_dir)),
        "PYTHONUNBUFFERED": "1",
    }
    with open(work_dir / "logs" / "launcher.log", "ab") as launcher_log:
        # A session of its own makes the whole tree (torchrun and every rank) one process group to stop.
        return subprocess.Popen(
            command, cwd=work_dir, env=env, stdout=launcher_log, stderr=subprocess.STDOUT, start_new_session=True
        )


def _supervise(process: subprocess.Popen, attempt_id: int) -> tuple[int, str | None]:
    """Wait for the process group to end; stop it on cancel or worker shutdown.

    Returns the exit code and who stopped it: "user", "worker" or None if it ended by itself."""
    while True:
        try:
            return process.wait(timeout=0.5), None
        except subprocess.TimeoutExpired:
            pass
        if Attempt.objects.filter(pk=attempt_id, cancel_requested=True).exists():
            return stop_process_group(process, settings.LOOM_CANCEL_GRACE_S), "user"
        if _shutting_down.is_set():
            return stop_process_group(process, settings.LOOM_CANCEL_GRACE_S), "worker"


def stop_process_group(process: subprocess.Popen, grace_s: float) -> int:
    """SIGTERM the group (ranks save and flush telemetry), SIGKILL whatever is left after grace_s.

    torchrun starts every rank in a session of its own, so a rank that ignores SIGTERM (hung in a
    collective) would outlive torchrun's group: the ranks are found by parentage first and killed too."""
    tree = [(pid, started_at(pid)) for pid in descendants(process.pid)]
    _signal_group(process.pid, signal.SIGTERM)
    try:
        exit_code = process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        _signal_group(process.pid, signal.SIGKILL)
        exit_code = process.wait()
    deadline = time.monotonic() + grace_s
    while (_group_alive(process.pid) or any(_same_process(*known) for known in tree)) and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal_group(process.pid, signal.SIGKILL)
    for pid, start in tree:
        if _same_process(pid, start):
            _signal_pid(pid, signal.SIGKILL)
    return exit_code


def descendants(pid: int) -> list[int]:
    """Every process below pid, from each process's parent in /proc (Linux, where torchrun runs)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        fields = stat_fields(int(entry.name))
        if fields is not None:
            children.setdefault(int(fields[PARENT_FIELD]), []).append(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        below = [child for parent in frontier for child in children.get(parent, [])]
        found += below
        frontier = below
    return found


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from its third field on (state, parent, …); None once the process is gone. The
    command name before them is in parentheses and may hold spaces, so the split is after its last ")"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def started_at(pid: int) -> str | None:
    """The process's start time in clock ticks since boot: with the pid it names one process, where a
    pid alone may have been reused by the time it is signalled."""
    fields = stat_fields(pid)
    return fields[START_TIME_FIELD] if fields is not None else None


def _same_process(pid: int, start: str | None) -> bool:
    return start is not None and started_at(pid) == start


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _outcome(exit_code: int, stopped_by: str | None, work_dir: Path) -> tuple[str, Failure | None]:
    if stopped_by == "user":
        return states.CANCELLED, Failure("cancelled", "cancelled by user")
    if exit_code == 0 and stopped_by is None:
        return states.SUCCEEDED, None
    return states.FAILED, classify(work_dir, worker_lost=stopped_by == "worker")


def _finish(reporter, attempt, work_dir, token, outcome: str, exit_code: int | None, failure: Failure | None) -> str:
    """Deliver what ranks left spooled (checkpoint commits included, which a restart needs), then the
    final state; record the end directly if the platform is unreachable."""
    ranks_left = deliver_spool(work_dir / "spool", settings.LOOM_INGEST_URL, token, DELIVERY_DEADLINE_S)
    reason = ""
    if failure is not None:
        reason = failure.reason if exit_code is None else f"torchrun exited with code {exit_code}\n{failure.reason}"
    final = {"attempt": attempt.number, "state": outcome, "exit_code": exit_code, "reason": reason}
    if outcome == states.FAILED:
        final |= {"failure_kind": failure.kind, "retryable": failure.retryable}
        # For the rank-exit alert: who failed first and the line that says why.
        final |= {"failure_rank": failure.rank, "failure_cause": failure.reason.partition("\n")[0]}
    reporter.emit("state", final)
    launcher_left = reporter.close(DELIVERY_DEADLINE_S)
    if ranks_left or launcher_left:
        log.error(
            "%s: %d rank and %d launcher batches could not be delivered; they stay spooled under %s",
            attempt, ranks_left, launcher_left, work_dir,
        )  # fmt: skip
        # The run must not look alive forever; the spooled events still carry the same final state.
        attempt.refresh_from_db()
        if attempt.state != outcome:
            move_attempt(
                attempt,
                outcome,
                exit_code=exit_code,
                reason=reason,
                failure_kind=final.get("failure_kind", ""),
                retryable=final.get("retryable"),
            )
    return outcome
