"""Processes on this host by /proc (Linux, where torchrun runs): who descends from whom, which process a pid
names now, and stopping a whole torchrun tree."""

import os
import signal
import subprocess
import time
from pathlib import Path

# Indexes into stat_fields(): /proc/<pid>/stat fields 3 (state), 4 (parent pid), 5 (process group) and 22
# (start time), counted from 3.
STATE_FIELD = 0
PARENT_FIELD = 1
GROUP_FIELD = 2
START_TIME_FIELD = 19


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


def same_process(pid: int, start: str | None) -> bool:
    """Whether pid still names the process that started at `start` and has not exited (a zombie has)."""
    fields = stat_fields(pid)
    return start is not None and fields is not None and fields[START_TIME_FIELD] == start and fields[STATE_FIELD] != "Z"


def live_group_members(pgid: int) -> list[int]:
    """The processes of group pgid that have not exited. A zombie still counts for kill(-pgid, 0), and one whose
    parent died stays a zombie where nothing reaps orphans, so the group is read from /proc instead."""
    members = []
    for entry in Path("/proc").glob("[0-9]*"):
        fields = stat_fields(int(entry.name))
        if fields is not None and int(fields[GROUP_FIELD]) == pgid and fields[STATE_FIELD] != "Z":
            members.append(int(entry.name))
    return members


def descendants(pid: int) -> list[int]:
    """Every process below pid, from each process's parent in /proc."""
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


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_process_group(process: subprocess.Popen, grace_s: float) -> int:
    """SIGTERM the group (ranks save and flush telemetry), SIGKILL whatever is left after grace_s.

    torchrun starts every rank in a session of its own, so a rank that ignores SIGTERM (hung in a
    collective) would outlive torchrun's group: the ranks are found by parentage first and killed too."""
    tree = [(pid, started_at(pid)) for pid in descendants(process.pid)]
    signal_group(process.pid, signal.SIGTERM)
    try:
        exit_code = process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        signal_group(process.pid, signal.SIGKILL)
        exit_code = process.wait()
    deadline = time.monotonic() + grace_s
    while (group_alive(process.pid) or any(same_process(*known) for known in tree)) and time.monotonic() < deadline:
        time.sleep(0.1)
    signal_group(process.pid, signal.SIGKILL)
    for pid, start in tree:
        if same_process(pid, start):
            signal_pid(pid, signal.SIGKILL)
    return exit_code


def stop_orphaned_group(pgid: int, grace_s: float) -> None:
    """stop_process_group for a group this process did not start (its supervisor is gone): SIGTERM, then SIGKILL
    for the group and everything below its leader that is left after grace_s."""
    tree = [(pid, started_at(pid)) for pid in descendants(pgid)]
    signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while (group_alive(pgid) or any(same_process(*known) for known in tree)) and time.monotonic() < deadline:
        time.sleep(0.1)
    signal_group(pgid, signal.SIGKILL)
    for pid, start in tree:
        if same_process(pid, start):
            signal_pid(pid, signal.SIGKILL)
