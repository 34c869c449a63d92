"""Launch backends: where an attempt's ranks run. `local` is torchrun on the worker's host (the embedded
default); `slurm` is the cluster's own scheduler, sbatch → srun → torchrun on every node.

A backend only submits, observes and cancels; what an observation means for the run (its end, a failure's
class, a restart) is loom.runs.lifecycle's business. Every call must be safe to repeat, and `observe` sees
all of a backend's active attempts in one call, so a reconciler pass costs one `squeue`, not one per run."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from django.conf import settings
from django.utils.module_loading import import_string

PENDING = "pending"  # accepted, not yet started (Slurm: waiting for nodes; pending_reason says why)
RUNNING = "running"
ENDED = "ended"  # the process or job is gone; exit_code and failure say how it went
UNKNOWN = "unknown"  # the backend could not say this time (slurmctld down): decide nothing, ask again


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a backend needs to start one attempt; nothing in it is backend-specific."""

    attempt_id: int
    run_id: int
    number: int
    work_dir: Path  # on the directory every node mounts; rank logs go to work_dir / "logs"
    config_path: Path
    nodes: int
    ranks_per_node: int
    env: dict[str, str]  # what every rank needs: LOOM_URL, LOOM_TOKEN, LOOM_ATTEMPT, …
    exclude: tuple[str, ...] = ()  # node names this attempt must not run on


@dataclass(frozen=True)
class Observation:
    state: str  # PENDING, RUNNING, ENDED or UNKNOWN
    exit_code: int | None = None
    # The backend's own account of an end that was not the program's doing: ("node_failure", "node n2 went
    # down"), ("timeout", …), ("preempted", …), ("cancelled", …), ("out_of_memory", …), ("lost", …): the
    # failure kind and its reason. Empty when the program ended by itself; the rank logs then tell why.
    backend_failure: tuple[str, str] | None = None
    pending_reason: str = ""
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodeInfo:
    name: str
    state: str  # idle, allocated, mixed, down, drained, … as the backend says it, lower case
    cpus: int
    gpus: int
    reason: str = ""  # why a node is down or drained, when the backend says

    @property
    def usable(self) -> bool:
        """Whether a launch may count on the node: none of its states ("idle+drain" holds two; "down*" is down
        and not responding) says it is down, draining or drained, failing, invalid, or unknown to its
        controller. The one rule for the capacity at launch, the nodes a restart avoids and node failures."""
        return not any(part.startswith(UNUSABLE_NODE_STATES) for part in self.state.split("+"))


UNUSABLE_NODE_STATES = ("down", "drain", "fail", "not_responding", "no_respond", "inval", "unknown")


class Backend(Protocol):
    name: str

    def submit(self, spec: LaunchSpec) -> dict:
        """Start the attempt; return a JSON handle (pid and start time, or a job id) that is stored on the
        attempt before anything else happens to it, so any process can observe or cancel it later."""

    def observe(self, handles: dict[int, dict]) -> dict[int, Observation]:
        """The state of every given attempt (attempt id → handle), in one look at the backend."""

    def cancel(self, handle: dict, grace_s: float) -> None:
        """Stop the attempt everywhere it runs: SIGTERM, then SIGKILL for what is left after grace_s.
        Returns at once; observe says when it is gone."""

    def nodes(self) -> list[NodeInfo]:
        """The nodes this backend can launch onto."""


@dataclass
class _Registry:
    backends: dict[str, Backend] = field(default_factory=dict)


_registry = _Registry()


def backend_named(name: str) -> Backend:
    """The backend `name` ("local", "slurm"), built once per process from LOOM_BACKENDS."""
    if name not in _registry.backends:
        if name not in settings.LOOM_BACKENDS:
            raise ValueError(f"unknown launch backend {name!r}; known: {', '.join(settings.LOOM_BACKENDS)}")
        _registry.backends[name] = import_string(settings.LOOM_BACKENDS[name])()
    return _registry.backends[name]


def current_backend() -> Backend:
    """The backend new attempts launch onto (LOOM_BACKEND)."""
    return backend_named(settings.LOOM_BACKEND)
