from datetime import datetime
from typing import Any

from ninja import Router, Schema, Status
from ninja.errors import HttpError

from loom.api.errors import Body, FieldErrors, Name, Text
from loom.telemetry.models import Event
from loom.telemetry.services import events_after
from trainer.config import world_size_of

from . import listing, services
from .hardware import warnings_for
from .logs import batches_set_aside, rank_log_files, tail_lines

router = Router(tags=["runs"])


class RunIn(Body):
    name: Name | None = None
    config: Any = None
    # Given, the planner's estimate of the config on this cluster is stored with the run.
    cluster: Any = None


class AttemptOut(Schema):
    number: int
    state: str
    exit_code: int | None
    failure_reason: str
    failure_kind: str
    retryable: bool | None
    restart_decision: str
    # The launch backend (local, slurm), the nodes its ranks ran on, and while it waits to start, why (the
    # scheduler's reason: Resources, Priority).
    backend: str
    nodes: list[str]
    pending_reason: str
    # created, restart (automatic) or restore (someone chose a checkpoint), and why in words.
    trigger: str
    trigger_note: str
    # The checkpoint it resumed from: its id and step; null when it started fresh.
    restored_from: int | None
    restored_from_step: int | None
    world_size: int
    parallel: dict
    # Telemetry batches the platform refused for good, kept in the attempt's spools' rejected/ folders.
    batches_set_aside: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None

    @staticmethod
    def resolve_batches_set_aside(attempt):
        return batches_set_aside(attempt.work_dir)

    @staticmethod
    def resolve_restored_from(attempt):
        return attempt.restored_from_id

    @staticmethod
    def resolve_restored_from_step(attempt):
        return attempt.restored_from.step if attempt.restored_from_id is not None else None

    @staticmethod
    def resolve_world_size(attempt):
        return world_size_of(attempt.config)

    @staticmethod
    def resolve_parallel(attempt):
        return attempt.config.get("parallel", {})


class RunPatchIn(Body):
    """What PATCH changes; a field left out (or null) stays as it is."""

    name: Name | None = None
    # The run's whole list of tags, replacing the ones it had.
    tags: list[str] | None = None
    note: Text | None = None
    # True: the run leaves the run list (GET /api/runs?archived=true lists it); false: it comes back.
    archived: bool | None = None


class RunOut(Schema):
    id: int
    name: str
    state: str
    created_at: datetime
    updated_at: datetime
    last_seq: int
    tags: list[str]
    note: str
    archived: bool
    archived_at: datetime | None

    @staticmethod
    def resolve_tags(run):
        return [tag.name for tag in run.tags.all()]

    @staticmethod
    def resolve_archived(run):
        return run.archived_at is not None


class ListedRunOut(RunOut):
    """A run as the list shows it (loom.runs.listing.listed_columns)."""

    # The latest attempt's parallel degrees (dp_replicate, dp_shard, tp, pp, cp, ep) and its ranks.
    layout: dict[str, int]
    world_size: int
    # The latest attempt's highest step reported, of the steps its config runs to; null before its first step.
    steps_done: int | None
    steps_total: int
    last_loss: float | None
    # Over all ranks: a rank's batch per second × the data-parallel degree, at the latest step that reported it.
    tokens_per_s: float | None
    # From its first attempt's start to its latest attempt's end, or to now while it is active; null: not started.
    duration_s: float | None
    # Its alerts open or acknowledged, and how many of those are critical.
    open_alerts: int
    critical_alerts: int


class RunPageOut(Schema):
    runs: list[ListedRunOut]
    # Pass one as `cursor` for the next or the previous page; null where there is none.
    next_cursor: str | None
    previous_cursor: str | None


class RunDetailOut(RunOut):
    config: dict
    estimate: dict | None
    attempts: list[AttemptOut]

    forked_from: int | None
    # The run and step of the checkpoint it was forked from; null for a run that was not forked.
    forked_from_run: int | None
    forked_from_step: int | None

    @staticmethod
    def resolve_attempts(run):
        return list(run.attempts.select_related("restored_from"))

    @staticmethod
    def resolve_forked_from(run):
        return run.forked_from_id

    @staticmethod
    def resolve_forked_from_run(run):
        return run.forked_from.run_id if run.forked_from_id is not None else None

    @staticmethod
    def resolve_forked_from_step(run):
        return run.forked_from.step if run.forked_from_id is not None else None


class RunCreatedOut(RunDetailOut):
    # What the run will do on the launcher's hardware other than its config and estimate suggest (bf16
    # on CPU, a prediction for other GPUs), keyed by field path as errors are; the run is created anyway.
    warnings: dict[str, str]

    @staticmethod
    def resolve_warnings(run):
        return warnings_for(run)


class EventOut(Schema):
    seq: int
    kind: str
    attempt: int | None
    rank: int | None
    step: int | None
    time: float
    payload: dict


class EventPage(Schema):
    events: list[EventOut]
    last_seq: int
    more: bool


class LogTail(Schema):
    rank: int
    attempt: int
    files: dict[str, list[str]]


@router.post("/runs", response={201: RunCreatedOut, 400: FieldErrors})
def create_run(request, body: RunIn):
    """Create a run from a name and a run-config document and queue its first attempt; with a
    cluster, the planner's estimate for it there is stored with the run. `warnings` says what the
    run will do on the launcher's hardware other than planned."""
    try:
        run = services.create_run(request.user, body.name, body.config, body.cluster)
    except services.RunInputError as error:
        return Status(400, {"errors": error.errors})
    return Status(201, run)


@router.get("/runs", response={200: RunPageOut, 400: FieldErrors})
def list_runs(
    request,
    search: str = "",
    state: str = "",
    tag: str = "",
    archived: bool = False,
    sort: str = listing.SORT_DEFAULT,
    limit: int = listing.LIMIT_DEFAULT,
    cursor: str = "",
):
    """Your runs, a page at a time: `search` (in the name, a tag or the note, case-insensitive), `state` (one or
    several, comma-separated), `tag`, `archived` (false: live runs only; true: archived ones only), `sort`
    (created, updated, name, state; "-" first for the other way; default -created: newest first), `limit` runs
    (1 to 200), `cursor` (a next_cursor or previous_cursor of the same sort: runs created meanwhile neither
    repeat nor skip one)."""
    try:
        query = listing.run_query(search, state, tag, archived, sort, limit, cursor)
    except services.RunInputError as error:
        return Status(400, {"errors": error.errors})
    return listing.run_page(request.user, query)


@router.get("/runs/{run_id}", response=RunDetailOut)
def run_detail(request, run_id: int):
    return services.run_for(request.user, run_id)


@router.patch("/runs/{run_id}", response={200: RunDetailOut, 400: FieldErrors})
def edit_run(request, run_id: int, body: RunPatchIn):
    """Rename a run, replace its tags, write its note, archive it or bring it back; a field left out stays as it
    is. Any bad field changes nothing: 400 names each."""
    run = services.run_for(request.user, run_id)
    try:
        return services.edit_run(run, **body.model_dump(exclude_none=True))
    except services.RunInputError as error:
        return Status(400, {"errors": error.errors})


@router.get("/runs/{run_id}/events", response={200: EventPage, 400: FieldErrors})
def run_events(request, run_id: int, after: int = 0, limit: int = 1000, until: int | None = None, kinds: str = ""):
    """Events with seq > after (and ≤ until), oldest first: the REST snapshot a page resyncs from.
    `kinds` (comma-separated) keeps only those kinds: a page that drew its charts from the metrics API
    reads the logs, states and checkpoints before that snapshot this way. `more` says a page is full."""
    run = services.run_for(request.user, run_id)
    wanted = [kind for kind in kinds.split(",") if kind]
    unknown = sorted(set(wanted) - set(Event.KINDS))
    if unknown:
        return Status(400, {"errors": {"kinds": f"unknown kinds {unknown}; valid choices are {Event.KINDS}"}})
    limit = max(1, min(limit, 5000))
    ceiling = run.last_seq if until is None else min(until, run.last_seq)
    events = events_after(run, after, limit, until=ceiling, kinds=wanted)
    more = len(events) == limit and events[-1].seq < ceiling
    return {"events": [event.as_wire() for event in events], "last_seq": run.last_seq, "more": more}


@router.post("/runs/{run_id}/cancel", response={202: RunDetailOut, 409: FieldErrors})
def cancel_run(request, run_id: int):
    run = services.run_for(request.user, run_id)
    try:
        return Status(202, services.cancel_run(run))
    except services.RunConflict as error:
        return Status(409, {"errors": {"run": str(error)}})


@router.get("/runs/{run_id}/attempts/{number}/logs/{rank}", response=LogTail)
def rank_logs(request, run_id: int, number: int, rank: int, lines: int = 200):
    """The tail of what a rank printed (stdout and stderr, as torchrun captured them)."""
    run = services.run_for(request.user, run_id)
    attempt = run.attempts.filter(number=number).first()
    if attempt is None or not 0 <= rank < world_size_of(attempt.config):
        raise HttpError(404, "no such attempt or rank")
    lines = max(1, min(lines, 5000))
    files = {}
    if attempt.work_dir:
        files = {path.name: tail_lines(path, lines) for path in rank_log_files(attempt.work_dir, rank)}
    return {"rank": rank, "attempt": number, "files": files}
