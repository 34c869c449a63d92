"""The nodes of a launch backend as loom sees them: what each runs for whom, what failed on it, and which
ones the next launches leave out.

One user never sees another's runs here: a node shows the asking user's own runs and ranks by name, and
everyone else's only as counts."""

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime

from django.db import IntegrityError, transaction

from loom.telemetry.models import RankStatus

from . import states
from .backends import Backend, NodeInfo, current_backend
from .models import Attempt, ExcludedNode

REASON_MAX_CHARS = 1000
# The state shown for an excluded node the backend no longer lists: it stays in the table so it can be
# included again.
NOT_REPORTED = "not reported"


class NodeInputError(ValueError):
    """Bad input about a node; `errors` maps fields ("name", "reason") to messages, as the run API's do."""

    def __init__(self, errors: dict[str, str]):
        super().__init__("; ".join(f"{key}: {message}" for key, message in errors.items()))
        self.errors = errors


@dataclass(frozen=True)
class Exclusion:
    reason: str
    # The username of who excluded it; None when loom did, after repeated failures.
    by: str | None
    at: datetime


@dataclass(frozen=True)
class RunOnNode:
    """One of the user's own active attempts on a node, with its ranks there (empty until they report)."""

    run_id: int
    run_name: str
    attempt: int
    state: str
    ranks: list[int]


@dataclass(frozen=True)
class NodeRow:
    name: str
    state: str
    cpus: int
    gpus: int
    reason: str
    excluded: Exclusion | None
    runs: list[RunOnNode] = field(default_factory=list)
    # Other users' active attempts on the node and how many of their ranks reported from it.
    other_runs: int = 0
    other_ranks: int = 0
    # Failed attempts that ran on the node, by failure kind.
    failures: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeTable:
    backend: str
    rows: list[NodeRow]
    # Why the backend's own nodes are missing from the rows (it could not list them); empty when it listed them.
    unavailable: str = ""


class BackendUnavailable(RuntimeError):
    """The backend could not list its nodes (slurmctld down, sinfo missing); the message says why."""


def reported_nodes(backend: Backend) -> list[NodeInfo]:
    try:
        return backend.nodes()
    except Exception as error:  # whatever a backend's commands fail with: said to the user, not a server error
        raise BackendUnavailable(f"the {backend.name} backend could not list its nodes: {error}") from error


def node_table(user, backend: Backend | None = None) -> NodeTable:
    """Every node of `backend` (the one new attempts launch onto unless given), and after them the excluded
    nodes it does not list, as `user` may see them. A backend that cannot list its nodes leaves only the
    excluded ones, so they can still be included."""
    backend = backend or current_backend()
    unavailable = ""
    try:
        reported = reported_nodes(backend)
    except BackendUnavailable as error:
        reported, unavailable = [], str(error)
    exclusions = {
        row.name: row for row in ExcludedNode.objects.filter(backend=backend.name).select_related("excluded_by")
    }
    placements = _active_placements(backend.name, {node.name for node in reported} | set(exclusions))
    failures = _failures_by_node(backend.name)
    rows = [
        _row(user, node.name, node.state, node.cpus, node.gpus, node.reason, exclusions, placements, failures)
        for node in reported
    ]
    known = {node.name for node in reported}
    rows += [
        _row(user, name, NOT_REPORTED, 0, 0, "", exclusions, placements, failures)
        for name in sorted(exclusions)
        if name not in known
    ]
    return NodeTable(backend.name, rows, unavailable)


def exclude_node(backend: Backend, name: str, reason: str, by=None) -> ExcludedNode:
    """Leave node `name` out of `backend`'s next launches; `by` is the user who asked, None for loom itself.
    Excluding an excluded node changes nothing: its first reason stands. Raises NodeInputError for a bad
    reason or a node the backend does not list, BackendUnavailable when it cannot list its nodes."""
    clean_reason = (reason or "").strip()
    errors = {}
    if not clean_reason:
        errors["reason"] = "is required: say why the node is left out, for whoever reads it next"
    elif len(clean_reason) > REASON_MAX_CHARS:
        errors["reason"] = f"must be at most {REASON_MAX_CHARS} characters (it has {len(clean_reason)})"
    names = [node.name for node in reported_nodes(backend)]
    if name not in names:
        errors["name"] = f"backend {backend.name} has no node {name!r}; its nodes are {', '.join(names) or 'none'}"
    if errors:
        raise NodeInputError(errors)
    existing = ExcludedNode.objects.filter(backend=backend.name, name=name).first()
    if existing is not None:
        return existing
    try:
        # Its own transaction, so a request that loses the race to exclude the node first rolls back only this.
        with transaction.atomic():
            return ExcludedNode.objects.create(backend=backend.name, name=name, reason=clean_reason, excluded_by=by)
    except IntegrityError:
        return ExcludedNode.objects.get(backend=backend.name, name=name)


def include_node(backend: Backend, name: str) -> bool:
    """Let `backend`'s next launches use node `name` again; False when it was not excluded."""
    deleted, _ = ExcludedNode.objects.filter(backend=backend.name, name=name).delete()
    return bool(deleted)


def excluded_names(backend: Backend) -> list[str]:
    """The nodes the next launch onto `backend` must leave out (its LaunchSpec.exclude), sorted."""
    return sorted(ExcludedNode.objects.filter(backend=backend.name).values_list("name", flat=True))


def failures_on(backend: Backend, name: str) -> dict[str, int]:
    """How many failed attempts of `backend` ran on node `name`, by failure kind ("" when unclassified)."""
    return _failures_by_node(backend.name).get(name, {})


def _row(user, name, state, cpus, gpus, reason, exclusions, placements, failures) -> NodeRow:
    own = []
    other_runs = other_ranks = 0
    for owner_id, run in placements.get(name, []):
        if owner_id == user.pk:
            own.append(run)
        else:
            other_runs += 1
            other_ranks += len(run.ranks)
    exclusion = exclusions.get(name)
    return NodeRow(
        name=name,
        state=state,
        cpus=cpus,
        gpus=gpus,
        reason=reason,
        excluded=_exclusion(exclusion) if exclusion else None,
        runs=sorted(own, key=lambda run: (run.run_id, run.attempt)),
        other_runs=other_runs,
        other_ranks=other_ranks,
        failures=dict(sorted(failures.get(name, {}).items())),
    )


def _exclusion(row: ExcludedNode) -> Exclusion:
    return Exclusion(row.reason, row.excluded_by.get_username() if row.excluded_by else None, row.excluded_at)


def _active_placements(backend_name: str, node_names: set[str]) -> dict[str, list[tuple[int, RunOnNode]]]:
    """node name → the active attempts on it, each with its run's owner: those the backend placed there
    (Attempt.nodes) and those whose ranks reported it as their host, with the ranks that did."""
    attempts = list(
        Attempt.objects.filter(backend=backend_name, state__in=states.ACTIVE)
        .select_related("run")
        .only("id", "number", "state", "nodes", "run__id", "run__name", "run__owner_id")
    )
    ranks_on = defaultdict(lambda: defaultdict(list))
    statuses = RankStatus.objects.filter(attempt__in=attempts).exclude(host="").order_by("rank")
    for attempt_id, rank, host in statuses.values_list("attempt_id", "rank", "host"):
        ranks_on[attempt_id][_node_of(host, node_names)].append(rank)
    placements = defaultdict(list)
    for attempt in attempts:
        ranks_by_node = ranks_on.get(attempt.pk, {})
        for node in dict.fromkeys([*attempt.nodes, *ranks_by_node]):
            run = RunOnNode(
                attempt.run_id, attempt.run.name, attempt.number, attempt.state, ranks_by_node.get(node, [])
            )
            placements[node].append((attempt.run.owner_id, run))
    return placements


def _node_of(host: str, node_names: set[str]) -> str:
    """The node a rank's host is: a host may report its full name (n1.cluster.example) where the backend
    lists the short one (n1)."""
    short = host.split(".", 1)[0]
    return short if host not in node_names and short in node_names else host


def _failures_by_node(backend_name: str) -> dict[str, dict[str, int]]:
    # Node lists are JSON: counted here, since SQLite cannot ask whether a JSON list holds a value.
    counts: dict[str, Counter] = defaultdict(Counter)
    failed = Attempt.objects.filter(backend=backend_name, state=states.FAILED).values_list("nodes", "failure_kind")
    for nodes, kind in failed:
        for node in set(nodes or []):
            counts[node][kind] += 1
    return {node: dict(kinds) for node, kinds in counts.items()}
