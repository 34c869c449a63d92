"""The embedded default: every rank of an attempt on this host, as `torchrun --standalone` under a supervisor
process of its own session (local_supervisor.py), so the attempt outlives the Celery worker that submitted it.

The handle is the supervisor's pid with its start time (a pid alone may be reused) and the identity of the pid
namespace it lives in: only a process that sees that namespace can observe or signal it (docker/compose.yaml
runs the monitor worker in the launch worker's pid namespace for that)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from django.conf import settings

import loom

from . import ENDED, RUNNING, UNKNOWN, LaunchSpec, NodeInfo, Observation
from .environment import rank_environment
from .local_supervisor import EXIT_RECORD, TORCHRUN_RECORD
from .process_tree import live_group_members, same_process, signal_pid, started_at, stop_orphaned_group

# The platform's source root and the repository's, for the supervisor's `python -m` (it imports loom and trainer).
PLATFORM_ROOT = Path(loom.__file__).resolve().parent.parent
REPO_ROOT = PLATFORM_ROOT.parent


def pid_namespace() -> str:
    """This process's pid namespace and boot: pids mean the same thing only to processes that share both."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{os.readlink('/proc/self/ns/pid')}@{boot}"


class LocalBackend:
    name = "local"

    @property
    def max_active(self) -> int:
        """Attempts this host runs at once: one machine has no scheduler to queue the rest."""
        return settings.LOOM_LOCAL_MAX_ATTEMPTS

    def submit(self, spec: LaunchSpec) -> dict:
        world_size = spec.nodes * spec.ranks_per_node
        torchrun = [
            sys.executable, "-m", "torch.distributed.run",
            "--standalone", f"--nproc_per_node={world_size}",
            "--log-dir", str(spec.work_dir / "logs"), "--redirects", "3",
            "-m", "trainer.train", "--config", str(spec.config_path),
        ]  # fmt: skip
        command = [
            sys.executable, "-m", "loom.runs.backends.local_supervisor",
            str(spec.work_dir), str(settings.LOOM_CANCEL_GRACE_S), "--", *torchrun,
        ]  # fmt: skip
        python_path = os.pathsep.join(filter(None, [str(PLATFORM_ROOT), str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        env = rank_environment(os.environ, {**spec.env, "PYTHONPATH": python_path, "PYTHONUNBUFFERED": "1"})
        with open(spec.work_dir / "logs" / "supervisor.log", "ab") as log:
            supervisor = subprocess.Popen(
                command, cwd=spec.work_dir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        # Reaped by a thread of its own: a supervisor's exit must not linger as a zombie of the worker.
        _reap_later(supervisor)
        return {
            "pid": supervisor.pid,
            "started_at": started_at(supervisor.pid),
            "pid_namespace": pid_namespace(),
            "host": socket.gethostname(),
            "work_dir": str(spec.work_dir),
        }

    def observe(self, handles: dict[int, dict]) -> dict[int, Observation]:
        here = pid_namespace()
        return {attempt_id: self._observe_one(handle, here) for attempt_id, handle in handles.items()}

    def _observe_one(self, handle: dict, here: str) -> Observation:
        if handle.get("pid_namespace") != here:
            return Observation(UNKNOWN)
        nodes = (handle["host"],)
        if same_process(handle["pid"], handle["started_at"]):
            return Observation(RUNNING, nodes=nodes)
        work_dir = Path(handle["work_dir"])
        exit_record = _record(work_dir / EXIT_RECORD)
        if exit_record is not None:
            return Observation(ENDED, exit_code=exit_record["exit_code"], nodes=nodes)
        # The supervisor died before torchrun ended: the attempt runs as long as torchrun's group does.
        torchrun = _record(work_dir / TORCHRUN_RECORD)
        if torchrun is not None and _group_alive(torchrun):
            return Observation(RUNNING, nodes=nodes)
        why = "the attempt's supervisor process ended without recording how torchrun ended"
        return Observation(ENDED, backend_failure=("lost", why), nodes=nodes)

    def cancel(self, handle: dict, grace_s: float) -> None:
        if handle.get("pid_namespace") != pid_namespace():
            return
        if same_process(handle["pid"], handle["started_at"]):
            signal_pid(handle["pid"], signal.SIGTERM)
            return
        # No supervisor to stop torchrun within the grace: stop its group here, the ranks it left too.
        torchrun = _record(Path(handle["work_dir"]) / TORCHRUN_RECORD)
        if torchrun is not None and _group_alive(torchrun):
            threading.Thread(
                target=stop_orphaned_group, args=(torchrun["pid"], grace_s), name="stop-torchrun", daemon=True
            ).start()

    def nodes(self) -> list[NodeInfo]:
        from loom.runs.hardware import launch_gpus

        gpus = launch_gpus() or ()
        return [NodeInfo(name=socket.gethostname(), state="up", cpus=os.cpu_count() or 1, gpus=len(gpus))]


def _record(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _group_alive(torchrun: dict) -> bool:
    """torchrun itself, or any process still in its group (ranks it started and left behind)."""
    return same_process(torchrun["pid"], torchrun["started_at"]) or bool(live_group_members(torchrun["pid"]))


def _reap_later(process: subprocess.Popen) -> None:
    threading.Thread(target=process.wait, name=f"reap-{process.pid}", daemon=True).start()
