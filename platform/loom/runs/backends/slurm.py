"""The Slurm backend: an attempt is one batch job, sbatch → srun (one task per node) → torchrun on every node.

Slurm 22.05 has no `scontrol --json` and its `squeue --json` ignores -j, so the plain formats are parsed,
by the pure functions below (tested with Slurm's own output). One observe pass is one `squeue` for every
attempt; `scontrol show job` is asked only about jobs squeue has forgotten.

Each node's torchrun writes under <work_dir>/logs/<node>/ (its launcher.log and the per-rank logs), with a
node.json that says which global ranks it ran: loom.runs.logs reads that layout. The node's rank is Slurm's
SLURM_NODEID through torchrun's static rendezvous, not c10d's: c10d orders nodes by host name, so a node's
ranks would not follow from anything Slurm or the work dir records."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from django.conf import settings

from . import ENDED, PENDING, RUNNING, UNKNOWN, LaunchSpec, NodeInfo, Observation
from .environment import rank_environment

COMMAND_TIMEOUT_S = 30
SQUEUE_FIELDS = ("JobID", "State", "Reason", "NodeList", "exit_code")
# Each field ends with the delimiter, none is cut to a width: `-O Field:|` prints it whole.
SQUEUE_FORMAT = ",".join(f"{name}:|" for name in SQUEUE_FIELDS)
SINFO_FORMAT = "%N|%T|%c|%G|%E"
# Ports a node can give a rendezvous store: below Linux's ephemeral range (32768+), so an outgoing
# connection never holds the port an attempt picked.
RENDEZVOUS_PORT_BASE = 20000
RENDEZVOUS_PORTS = 10000

WAITING_STATES = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"})
HOLDING_STATES = frozenset({"RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESIZING"})
# Ends that were Slurm's doing, not the program's: the failure kind and how to say it.
BACKEND_ENDS = {
    "CANCELLED": ("cancelled", "Slurm cancelled job {job} (scancel, or an administrator)"),
    "TIMEOUT": ("timeout", "job {job} reached its time limit"),
    "DEADLINE": ("timeout", "job {job} reached its deadline"),
    "NODE_FAIL": ("node_failure", "Slurm ended job {job} on a node failure"),
    "BOOT_FAIL": ("node_failure", "a node of job {job} failed to boot"),
    "OUT_OF_MEMORY": ("out_of_memory", "job {job} ran out of memory (Slurm's memory limit)"),
    "PREEMPTED": ("preempted", "job {job} was preempted by a higher-priority job"),
    "REVOKED": ("cancelled", "job {job} was revoked (it started on another federated cluster)"),
}
PROGRAM_ENDS = frozenset({"COMPLETED", "FAILED", "SPECIAL_EXIT"})
# What scancel says of a job that has already ended or been forgotten: cancelling it again is done.
FINISHED_JOB_ERRORS = re.compile(r"Invalid job id|already completing or completed|Job/step already", re.IGNORECASE)


class SlurmCommandError(RuntimeError):
    pass


# --- pure parsing and mapping -------------------------------------------------------------------------


def expand_nodelist(nodelist: str) -> tuple[str, ...]:
    """Slurm's compressed host list ("n[1-3,5],gpu-[01-02],login") as names, in Slurm's order."""
    names: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]*)\[([^\]]*)\]|([^,\[\]]+)", nodelist):
        if plain:
            names.append(plain)
            continue
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            width = len(first)
            for number in range(int(first), int(last or first) + 1):
                names.append(f"{prefix}{number:0{width}d}")
    return tuple(names)


def parse_squeue(text: str) -> dict[str, dict]:
    """Job id → {state, reason, nodes, exit_code} from `squeue -h -O` lines of SQUEUE_FORMAT."""
    jobs = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        values = [value.strip() for value in line.split("|")]
        job = dict(zip(SQUEUE_FIELDS, values, strict=False))
        jobs[job["JobID"]] = {
            "state": job.get("State", ""),
            "reason": job.get("Reason", ""),
            "nodes": job.get("NodeList", ""),
            "exit_code": decode_wait_status(job.get("exit_code", "")),
        }
    return jobs


def parse_scontrol_job(text: str) -> dict:
    """One job from `scontrol show job -o`, as the same keys parse_squeue gives."""
    fields = dict(re.findall(r"(\w+)=(\S*)", text))
    code, _, signal_number = fields.get("ExitCode", "0:0").partition(":")
    exit_code = -int(signal_number) if signal_number not in ("", "0") else int(code or 0)
    return {
        "state": fields.get("JobState", ""),
        "reason": fields.get("Reason", ""),
        "nodes": "" if fields.get("NodeList") == "(null)" else fields.get("NodeList", ""),
        "exit_code": exit_code,
    }


def decode_wait_status(raw: str) -> int | None:
    """squeue's exit_code is the batch script's raw wait status: the code in the high byte, a signal in the
    low bits. A signal comes back negative, as a subprocess's returncode does."""
    if not raw.strip().lstrip("-").isdigit():
        return None
    status = int(raw)
    return -(status & 0x7F) if status & 0x7F else status >> 8


def observation_of(job_id: str, job: dict, down_nodes: dict[str, str] | None = None) -> Observation:
    """What a job's state, reason, nodes and exit code mean for its attempt. down_nodes (name → Slurm's
    reason) lets a node failure name the node that failed."""
    state = job["state"].split()[0].rstrip("+") if job["state"] else ""
    nodes = expand_nodelist(job["nodes"]) if job["nodes"] else ()
    if state in WAITING_STATES:
        return Observation(PENDING, pending_reason=job["reason"] if job["reason"] != "None" else "")
    if state in HOLDING_STATES:
        # A COMPLETING job lists only the nodes it has not released yet (after a node failure, not the failed
        # one): the attempt's nodes are the union of what it was seen on.
        return Observation(RUNNING, nodes=nodes)
    if state in PROGRAM_ENDS:
        exit_code = job["exit_code"] if state != "COMPLETED" else 0
        return Observation(ENDED, exit_code=exit_code, nodes=nodes)
    if state in BACKEND_ENDS:
        kind, template = BACKEND_ENDS[state]
        reason = template.format(job=job_id)
        if kind == "node_failure":
            reason = node_failure_reason(reason, nodes, down_nodes or {})
        return Observation(ENDED, exit_code=job["exit_code"], backend_failure=(kind, reason), nodes=nodes)
    return Observation(UNKNOWN)


def node_failure_reason(reason: str, nodes: tuple[str, ...], down_nodes: dict[str, str]) -> str:
    """Name the job's nodes Slurm now holds down (the failure the next attempt should avoid)."""
    failed = [node for node in nodes if node in down_nodes]
    if failed:
        return "; ".join(f"node {node} failed ({down_nodes[node]})" for node in failed) + f": {reason}"
    return f"{reason} (Slurm no longer says which of {', '.join(nodes) or 'its nodes'})"


def lost(job_id: str) -> Observation:
    return Observation(ENDED, backend_failure=("lost", f"Slurm no longer knows job {job_id}"))


def parse_sinfo_nodes(text: str) -> list[NodeInfo]:
    """NodeInfo per line of `sinfo -h -N -o SINFO_FORMAT`; a node in several partitions is listed once."""
    nodes: dict[str, NodeInfo] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        name, state, cpus, gres, reason = (line.split("|", 4) + [""] * 5)[:5]
        nodes.setdefault(
            name,
            NodeInfo(
                name=name,
                state=state.strip().rstrip("*~#!%$@^+-").lower(),
                cpus=int(cpus) if cpus.strip().isdigit() else 0,
                gpus=gpus_in(gres),
                reason="" if reason.strip() == "none" else reason.strip(),
            ),
        )
    return list(nodes.values())


def gpus_in(gres: str) -> int:
    """GPUs in a Gres string such as "gpu:8", "gpu:a100:4(S:0-1)" or "gpu:2,shard:8"; 0 for "(null)"."""
    total = 0
    for item in re.split(r",(?![^(]*\))", gres):
        parts = re.sub(r"\(.*\)", "", item).split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def rendezvous_port(attempt_id: int) -> int:
    return RENDEZVOUS_PORT_BASE + attempt_id % RENDEZVOUS_PORTS


def batch_script(spec: LaunchSpec, partition: str = "", account: str = "") -> str:
    """The job: whole nodes, one srun task per node, and node.sh (node_script) in each of them."""
    work_dir = Path(spec.work_dir)
    options = [
        f"--job-name=loom-run{spec.run_id}-attempt{spec.number}",
        f"--nodes={spec.nodes}",
        "--ntasks-per-node=1",
        # loom makes the next attempt itself (from a checkpoint, without the failed node): a job Slurm
        # requeued after a node failure would start again beside it.
        "--no-requeue",
        # Every rank of a node belongs to this job: all its CPUs (and GPUs) are the job's.
        "--exclusive",
        "--open-mode=append",
        f"--output={work_dir / 'logs' / 'batch.out'}",
        f"--chdir={work_dir}",
    ]
    if spec.exclude:
        options.append(f"--exclude={','.join(spec.exclude)}")
    if partition:
        options.append(f"--partition={partition}")
    if account:
        options.append(f"--account={account}")
    exports = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in sorted(spec.env.items()))
    return (
        "#!/bin/bash\n"
        + "".join(f"#SBATCH {option}\n" for option in options)
        + "set -euo pipefail\n"
        + exports
        + 'LOOM_RENDEZVOUS_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
        + "export LOOM_RENDEZVOUS_HOST\n"
        + f"exec srun --kill-on-bad-exit=1 bash {shlex.quote(str(work_dir / 'node.sh'))}\n"
    )


def node_script(spec: LaunchSpec) -> str:
    """One node's part: torchrun for its ranks, its output in logs/<node>/launcher.log."""
    work_dir = Path(spec.work_dir)
    launcher = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={spec.nodes}", f"--nproc_per_node={spec.ranks_per_node}",
        "--rdzv_backend=static", f"--rdzv_id=loom-{spec.attempt_id}", "--redirects", "3",
    ]  # fmt: skip
    this_node = (
        '--node_rank="$SLURM_NODEID" '
        f'--rdzv_endpoint="$LOOM_RENDEZVOUS_HOST:{rendezvous_port(spec.attempt_id)}" '
        '--log-dir "$node_logs"'
    )
    trainer = ["-m", "trainer.train", "--config", str(spec.config_path)]
    return (
        "#!/bin/bash\n"
        "set -euo pipefail\n"
        f'node_logs={shlex.quote(str(work_dir / "logs"))}/"$SLURMD_NODENAME"\n'
        'mkdir -p "$node_logs"\n'
        f"first_rank=$((SLURM_NODEID * {spec.ranks_per_node}))\n"
        'printf \'{"node": "%s", "node_rank": %d, "first_rank": %d}\\n\' '
        '"$SLURMD_NODENAME" "$SLURM_NODEID" "$first_rank" > "$node_logs/node.json"\n'
        f'exec {shlex.join(launcher)} {this_node} {shlex.join(trainer)} >> "$node_logs/launcher.log" 2>&1\n'
    )


# --- the backend -----------------------------------------------------------------------------------------


class SlurmBackend:
    name = "slurm"
    # An attempt's ranks are spread over nodes of LOOM_RANKS_PER_NODE ranks (loom.runs.launcher.node_shape).
    spans_nodes = True

    def submit(self, spec: LaunchSpec) -> dict:
        work_dir = Path(spec.work_dir)
        (work_dir / "logs").mkdir(parents=True, exist_ok=True)
        (work_dir / "node.sh").write_text(node_script(spec))
        script = work_dir / "job.sbatch"
        # It holds the attempt's token: readable by the user loom runs as only (sbatch reads it as that user).
        script.touch(mode=0o600)
        script.write_text(batch_script(spec, settings.LOOM_SLURM_PARTITION, settings.LOOM_SLURM_ACCOUNT))
        # The job starts with sbatch's environment (Slurm's --export=ALL): sbatch gets the ranks' allow-list, not
        # the worker's secrets; the script exports the attempt's own variables.
        output = self._slurm(
            "sbatch", "--parsable", str(script), cwd=work_dir, environment=rank_environment(os.environ, {})
        ).stdout.strip()
        # --parsable prints "<id>" or "<id>;<cluster>".
        return {"job_id": output.split(";")[0]}

    def observe(self, handles: dict[int, dict]) -> dict[int, Observation]:
        job_ids = {attempt_id: str(handle["job_id"]) for attempt_id, handle in handles.items()}
        if not job_ids:
            return {}
        try:
            jobs = self._squeue(sorted(set(job_ids.values())))
        except SlurmCommandError:
            return {attempt_id: Observation(UNKNOWN) for attempt_id in job_ids}
        observations = {}
        down = None
        for attempt_id, job_id in job_ids.items():
            job = jobs.get(job_id)
            if job is None:
                try:
                    job = self._scontrol_job(job_id)
                except SlurmCommandError:
                    observations[attempt_id] = Observation(UNKNOWN)
                    continue
                if job is None:
                    observations[attempt_id] = lost(job_id)
                    continue
            if job["state"].startswith(("NODE_FAIL", "BOOT_FAIL")) and down is None:
                down = self._down_nodes()
            observations[attempt_id] = observation_of(job_id, job, down)
        return observations

    def cancel(self, handle: dict, grace_s: float) -> None:
        # scancel sends SIGTERM, then SIGKILL after the cluster's KillWait: Slurm's grace, not ours.
        result = self._slurm("scancel", str(handle["job_id"]), check=False)
        if result.returncode != 0 and not FINISHED_JOB_ERRORS.search(result.stderr):
            raise SlurmCommandError(f"scancel {handle['job_id']} failed ({result.returncode}): {result.stderr.strip()}")

    def nodes(self) -> list[NodeInfo]:
        return parse_sinfo_nodes(self._slurm("sinfo", "-h", "-N", "-o", SINFO_FORMAT).stdout)

    def _squeue(self, job_ids: list[str]) -> dict[str, dict]:
        result = self._slurm(
            "squeue", "-h", "--states=all", f"--jobs={','.join(job_ids)}", "-O", SQUEUE_FORMAT, check=False
        )
        if result.returncode != 0:
            # squeue fails the whole call when none of the ids is one it knows.
            if "Invalid job id" in result.stderr:
                return {}
            raise SlurmCommandError(f"squeue failed ({result.returncode}): {result.stderr.strip()}")
        return parse_squeue(result.stdout)

    def _scontrol_job(self, job_id: str) -> dict | None:
        result = self._slurm("scontrol", "show", "job", "-o", job_id, check=False)
        if result.returncode != 0:
            if "Invalid job id" in result.stderr:
                return None
            raise SlurmCommandError(f"scontrol show job {job_id} failed: {result.stderr.strip()}")
        return parse_scontrol_job(result.stdout)

    def _down_nodes(self) -> dict[str, str]:
        try:
            nodes = self.nodes()
        except SlurmCommandError:
            return {}
        unusable = [node for node in nodes if not node.usable]
        return {node.name: f"{node.state}: {node.reason}" if node.reason else node.state for node in unusable}

    def _slurm(
        self, *command: str, check: bool = True, cwd: Path | None = None, environment: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        env = dict(os.environ if environment is None else environment)
        if settings.LOOM_SLURM_CONF:
            env["SLURM_CONF"] = settings.LOOM_SLURM_CONF
        try:
            result = subprocess.run(
                command, capture_output=True, text=True, env=env, cwd=cwd, timeout=COMMAND_TIMEOUT_S
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            raise SlurmCommandError(f"{command[0]} could not run: {error}") from error
        if check and result.returncode != 0:
            raise SlurmCommandError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}")
        return result
