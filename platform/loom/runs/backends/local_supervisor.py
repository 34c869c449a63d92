"""One attempt's supervisor on this host, started by the local backend in a session of its own so that it
outlives the Celery worker that started it (a worker restart or `kill -9` leaves the run training).

It runs torchrun, reports RUNNING as the launcher (rank -1) through the ingest API, stops torchrun's whole
tree on SIGTERM (a cancel) within the grace period, and once torchrun has ended delivers what the ranks left
spooled (checkpoint commits included, which a restart needs), reports the final state with its failure class
and how many batches the platform refused (set aside in the spools' rejected/ folders), and last writes
<work_dir>/exit.json: the reconciler ends the attempt from that record, or from the logs, when the report
never arrived. Imports no Django: it needs only the trainer's telemetry client.

    python -m loom.runs.backends.local_supervisor <work_dir> <grace_s> -- <torchrun command…>
"""

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from trainer.telemetry import TelemetryClient, deliver_spool, set_aside_count

from ..failures import classify
from .process_tree import started_at, stop_process_group

LAUNCHER_RANK = -1
DELIVERY_DEADLINE_S = 120.0
EXIT_RECORD = "exit.json"
# torchrun's pid and start time, written as soon as it runs: should the supervisor itself die (the OOM killer,
# a stray kill), the backend still follows and stops torchrun's process group by it.
TORCHRUN_RECORD = "torchrun.json"


def report_final_state(reporter: TelemetryClient, number: int, exit_code: int, cancelled: bool, work_dir: Path):
    # The batches the platform refused for good, of the ranks and of the launcher itself: set aside in the
    # spools (not lost, not retried), counted where the platform shows the attempt's end.
    set_aside = set_aside_count(work_dir / "spool") + set_aside_count(reporter.spool_dir)
    final: dict = {"attempt": number, "exit_code": exit_code, "batches_set_aside": set_aside}
    if cancelled:
        final |= {"state": "cancelled", "reason": "cancelled by user"}
    elif exit_code == 0:
        final |= {"state": "succeeded"}
    else:
        failure = classify(work_dir)
        final |= {
            "state": "failed",
            "reason": f"torchrun exited with code {exit_code}\n{failure.reason}",
            "failure_kind": failure.kind,
            "retryable": failure.retryable,
            # For the rank-exit alert: who failed first and the line that says why.
            "failure_rank": failure.rank,
            "failure_cause": failure.reason.partition("\n")[0],
        }
    reporter.emit("state", final)


def write_record(path: Path, record: dict) -> None:
    """Whole or not at all: a reader never sees half a record."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(record))
    os.replace(partial, path)


def main(argv: list[str]) -> int:
    work_dir, grace_s, separator, *command = argv
    if separator != "--" or not command:
        raise SystemExit("usage: local_supervisor <work_dir> <grace_s> -- <command…>")
    work_dir, grace_s = Path(work_dir), float(grace_s)
    url, token, attempt = os.environ["LOOM_URL"], os.environ["LOOM_TOKEN"], int(os.environ["LOOM_ATTEMPT"])
    number = int(os.environ["LOOM_ATTEMPT_NUMBER"])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    reporter = TelemetryClient(
        url=url,
        token=token,
        attempt=attempt,
        rank=LAUNCHER_RANK,
        spool_dir=work_dir / "launcher-spool",
        flush_interval_s=0.1,
        heartbeat_interval_s=None,
    )
    with open(work_dir / "logs" / "launcher.log", "ab") as launcher_log:
        # A session of its own makes torchrun and every rank one process group to stop.
        torchrun = subprocess.Popen(
            command, cwd=work_dir, stdout=launcher_log, stderr=subprocess.STDOUT, start_new_session=True
        )
    write_record(work_dir / TORCHRUN_RECORD, {"pid": torchrun.pid, "started_at": started_at(torchrun.pid)})
    reporter.emit("state", {"attempt": number, "state": "running", "pid": torchrun.pid})
    while True:
        try:
            exit_code = torchrun.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            if stop.is_set():
                exit_code = stop_process_group(torchrun, grace_s)
                break
    deliver_spool(work_dir / "spool", url, token, DELIVERY_DEADLINE_S)
    report_final_state(reporter, number, exit_code, stop.is_set(), work_dir)
    reporter.close(DELIVERY_DEADLINE_S)
    write_record(work_dir / EXIT_RECORD, {"exit_code": exit_code, "stopped_by_signal": stop.is_set()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
