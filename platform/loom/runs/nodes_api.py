from datetime import datetime

from ninja import Router, Schema, Status

from loom.api.errors import Body, FieldErrors, Text

from . import nodes
from .backends import current_backend

router = Router(tags=["nodes"])


class ExclusionOut(Schema):
    reason: str
    # The username of who excluded the node; null when loom did, after repeated failures on it.
    by: str | None
    at: datetime


class RunOnNodeOut(Schema):
    run: int
    name: str
    attempt: int
    state: str
    # The ranks that reported this node as their host; empty until they have.
    ranks: list[int]

    @staticmethod
    def resolve_run(placement):
        return placement.run_id

    @staticmethod
    def resolve_name(placement):
        return placement.run_name


class NodeOut(Schema):
    name: str
    # As the backend says it (idle, allocated, mixed, down, drained, …); "not reported" for an excluded node
    # the backend no longer lists.
    state: str
    cpus: int
    gpus: int
    # Why the backend has it down or drained, when it says.
    reason: str
    excluded: ExclusionOut | None
    # The asking user's own active runs on the node; other users' only as counts.
    runs: list[RunOnNodeOut]
    other_runs: int
    other_ranks: int
    # Failed attempts that ran on the node, by failure kind.
    failures: dict[str, int]


class NodeTableOut(Schema):
    backend: str
    nodes: list[NodeOut]
    # Why the backend's own nodes are missing (it could not list them: slurmctld down, say); only the excluded
    # nodes are listed then. Empty when it listed them.
    unavailable: str

    @staticmethod
    def resolve_nodes(table):
        return table.rows


class ExcludeIn(Body):
    reason: Text = ""


class ExcludedOut(Schema):
    backend: str
    name: str
    reason: str
    by: str | None
    at: datetime

    @staticmethod
    def resolve_by(row):
        return row.excluded_by.get_username() if row.excluded_by else None

    @staticmethod
    def resolve_at(row):
        return row.excluded_at


@router.get("/nodes", response=NodeTableOut)
def list_nodes(request):
    """Every node of the backend new runs launch onto: its state, CPUs and GPUs, your runs and ranks on it,
    how many ranks of other users' runs, the attempts that failed on it, and whether launches leave it out."""
    return nodes.node_table(request.user, current_backend())


@router.post("/nodes/{name}/exclude", response={200: ExcludedOut, 400: FieldErrors, 503: FieldErrors})
def exclude_node(request, name: Text, body: ExcludeIn):
    """Leave the node out of the next launches (Slurm's --exclude); runs already on it go on. Excluding an
    excluded node changes nothing: the first reason stands."""
    try:
        return nodes.exclude_node(current_backend(), name, body.reason, by=request.user)
    except nodes.NodeInputError as error:
        return Status(400, {"errors": error.errors})
    except nodes.BackendUnavailable as error:
        return Status(503, {"errors": {"backend": f"{error}; try again once it answers"}})


@router.delete("/nodes/{name}/exclude", response={204: None})
def include_node(request, name: Text):
    """Let the next launches use the node again; a node that was not excluded stays as it was."""
    nodes.include_node(current_backend(), name)
    return Status(204, None)
