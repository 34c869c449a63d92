from datetime import datetime
from typing import Any

from django.http import JsonResponse
from ninja import Router, Schema, Status

from loom.api.errors import Body, FieldErrors, Name
from loom.runs import services as run_services
from loom.runs.models import Attempt, Run
from loom.telemetry.ingest import bearer
from loom.telemetry.services import IngestRejected, attempt_for_token, refuse_expired_token
from trainer.config import AlertsConfig

from . import services
from .resilience import resilience

router = Router(tags=["checkpoints"])


class CheckpointOut(Schema):
    id: int
    run: int
    attempt: int
    step: int
    state: str
    path: str
    bytes: int
    layout: dict
    world_size: int
    parent: int | None
    loss: float | None
    stall_s: float | None
    save_s: float | None
    problem: str
    committed_at: datetime
    pinned: bool
    # Why retention keeps it: "pinned by alert #12 (loss spike at step 70)", "pinned by ada".
    pins: list[str]
    # Pinned by a person: unpin takes that back (an alert's pin lasts while the alert is live).
    user_pinned: bool

    @staticmethod
    def resolve_run(checkpoint):
        return checkpoint.run_id

    @staticmethod
    def resolve_attempt(checkpoint):
        return checkpoint.attempt.number

    @staticmethod
    def resolve_parent(checkpoint):
        return checkpoint.parent_id

    @staticmethod
    def resolve_pinned(checkpoint):
        return bool(checkpoint.pins)


class RestoreIn(Body):
    checkpoint: Any = None
    # "attempt": the run's next attempt; "fork": the first attempt of a new run.
    mode: Any = "attempt"
    # Fields of the config's parallel section to change (tp, pp, dp_shard, …); the rest stay as saved.
    parallel: Any = None
    steps: Any = None
    name: Name | None = None
    # Past a loss spike: a new peak learning rate, and [first, last] steps whose data the attempt skips.
    lr: Any = None
    skip_steps: Any = None


class RestoredOut(Schema):
    run: int
    attempt: int
    forked: bool


@router.get("/runs/{run_id}/checkpoints", response=list[CheckpointOut])
def run_checkpoints(request, run_id: int):
    """Every checkpoint the run's attempts committed, oldest step first, with its state and pins."""
    run = run_services.run_for(request.user, run_id)
    return services.with_pins(run, services.checkpoints_of(run))


@router.post("/runs/{run_id}/checkpoints/{checkpoint_id}/pin", response={200: CheckpointOut, 400: FieldErrors})
def pin_checkpoint(request, run_id: int, checkpoint_id: int):
    """Keep a committed checkpoint past retention (keep_last) until unpinned."""
    run = run_services.run_for(request.user, run_id)
    try:
        return services.pin(request.user, run, checkpoint_id)
    except run_services.RunInputError as error:
        return Status(400, {"errors": error.errors})


@router.post("/runs/{run_id}/checkpoints/{checkpoint_id}/unpin", response=CheckpointOut)
def unpin_checkpoint(request, run_id: int, checkpoint_id: int):
    """Take back your pin; an open alert's pin on the checkpoint stays until the alert is resolved."""
    return services.unpin(request.user, run_services.run_for(request.user, run_id), checkpoint_id)


@router.get("/checkpoints/pinned", auth=None, openapi_extra={"security": [{"AttemptToken": []}]})
def pinned_checkpoints(request):
    """For a running attempt's retention, with the attempt's own token: its run's pinned checkpoints and the
    last step its alerts have judged (null when its alerts are off: nothing to wait for),
    {"pinned": {path: [why, …]}, "judged_through": n}. 401 for an unknown token, or one whose attempt
    finished longer than LOOM_INGEST_GRACE_S ago."""
    try:
        ref = attempt_for_token(bearer(request.headers.get("Authorization", "")))
        refuse_expired_token(ref)
    except IngestRejected as rejected:
        return JsonResponse(rejected.answer(), status=rejected.status)
    attempt = Attempt.objects.get(pk=ref.attempt_id)
    alerts_on = AlertsConfig.model_validate(attempt.config.get("alerts", {})).enabled
    judged_through = (attempt.alerts_judged_through or 0) if alerts_on else None
    return {"pinned": services.pinned_paths(Run.objects.get(pk=ref.run_id)), "judged_through": judged_through}


@router.get("/runs/{run_id}/lineage")
def run_lineage(request, run_id: int):
    """The run's family (the run it was forked from, runs forked from it) as attempts and checkpoints."""
    return services.lineage(run_services.run_for(request.user, run_id))


@router.get("/runs/{run_id}/resilience")
def run_resilience(request, run_id: int):
    """RPO and RTO per failure, ETTR, checkpoint stall and the Young/Daly save interval."""
    return resilience(run_services.run_for(request.user, run_id))


@router.post("/runs/{run_id}/restore", response={201: RestoredOut, 400: FieldErrors})
def restore(request, run_id: int, body: RestoreIn):
    """Restore a committed checkpoint, as the run's next attempt or as a new run forked from it,
    optionally in another layout (validated like any config)."""
    run = run_services.run_for(request.user, run_id)
    steps = body.steps if body.steps not in (None, "") else None
    try:
        attempt = services.restore(
            request.user, run, body.checkpoint, body.mode, body.parallel, steps, body.name, body.lr, body.skip_steps
        )
    except run_services.RunInputError as error:
        return Status(400, {"errors": error.errors})
    return Status(201, {"run": attempt.run_id, "attempt": attempt.number, "forked": attempt.run_id != run.pk})
