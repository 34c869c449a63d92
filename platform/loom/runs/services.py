"""Run business rules: creating, cancelling and moving attempts through their states."""

import re

from celery import current_app
from django.contrib.auth import get_user_model
from django.db import transaction
from django.http import Http404
from django.utils import timezone

from loom.checkpoints.models import COMMITTED, Checkpoint
from loom.datasets.references import RunSources, compatibility_errors, referenced_sources, with_model_of_weights
from loom.planner.services import estimate_for_run
from trainer.config import ConfigError, parse_config

from . import states
from .limits import launch_limit_errors, owner_limit_errors
from .models import Attempt, Run, RunTag

# Celery task names (loom.runs.tasks), sent by name: the tasks import this module, not the other way round.
LAUNCH_TASK = "loom.launch_attempt"
CANCEL_TASK = "loom.runs.cancel_attempt"


class RunInputError(ValueError):
    """Bad user input; `errors` maps field paths ("name", "config.model.heads") to messages."""

    def __init__(self, errors: dict[str, str]):
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))
        self.errors = errors


class RunConflict(ValueError):
    pass


def validate_run_input(
    name, document, cluster=None, owner=None
) -> tuple[str, dict, dict | None, Checkpoint | None, RunSources]:
    """The clean name, the config with defaults filled in, given a cluster the planner's estimate of the
    config on it (its errors keyed "cluster.…" like the config's "config.…"), the checkpoint it resumes
    from, and the dataset and starting weights it names. The platform places checkpoints: the config names no
    directory, and resumes from a checkpoint of `owner`'s by reference (resolved_resume), which the stored config
    holds as that checkpoint's path. A dataset and starting weights are `owner`'s too, named by reference
    (loom.datasets.references), which the stored config keeps: the launcher gives the ranks their directories."""
    errors: dict[str, str] = name_errors(name)
    config = None
    placement_errors, document, source = resolved_resume(document, owner)
    errors.update(placement_errors)
    reference_errors, sources = referenced_sources(document, owner)
    errors.update(reference_errors)
    document = with_model_of_weights(document, sources)
    try:
        config = parse_config(document)
    except ConfigError as error:
        errors.update({f"config.{field}": message for field, message in error.errors.items()})
    if config is not None:
        for field, message in compatibility_errors(config, sources).items():
            errors.setdefault(field, message)
    clean_config = config.model_dump(mode="json") if config is not None else None
    estimate = None
    if clean_config is not None and cluster is not None:
        try:
            estimate = estimate_for_run(clean_config, cluster)
        except ConfigError as error:
            errors.update({estimate_error_key(field): message for field, message in error.errors.items()})
    if errors:
        raise RunInputError(errors)
    return name.strip(), clean_config, estimate, source, sources


def name_errors(name) -> dict[str, str]:
    if not isinstance(name, str) or not name.strip():
        return {"name": "is required"}
    if len(name.strip()) > 200:
        return {"name": "must be at most 200 characters"}
    return {}


RESUME_REFERENCES = (
    '"latest" (the newest in the attempt\'s own directory; a new run has none and starts fresh), '
    '"checkpoint:<id>" or "run:<id>/step:<n>" (a committed checkpoint of one of your runs)'
)
CHECKPOINT_REFERENCE = re.compile(r"^checkpoint:(\d{1,18})$")
RUN_STEP_REFERENCE = re.compile(r"^run:(\d{1,18})/step:(\d{1,18})$")


def resolved_resume(document, owner) -> tuple[dict[str, str], object, Checkpoint | None]:
    """Field errors for a config that places checkpoints itself, the document with its resume reference
    replaced by the path of the owner's committed checkpoint it names, and that checkpoint. Someone else's
    checkpoint reads as a missing one: an answer must not tell whether it exists."""
    section = document.get("checkpoint") if isinstance(document, dict) else None
    if not isinstance(section, dict):
        return {}, document, None
    errors: dict[str, str] = {}
    if section.get("directory") is not None:
        errors["config.checkpoint.directory"] = (
            "is chosen by the platform: each attempt writes its checkpoints into its own directory under the "
            "runs directory; leave it out"
        )
    resume = section.get("resume")
    if not isinstance(resume, str) or resume == "latest":
        return errors, document, None
    checkpoint, problem = _referenced_checkpoint(resume, owner)
    if problem:
        errors["config.checkpoint.resume"] = problem
        return errors, document, None
    return errors, {**document, "checkpoint": {**section, "resume": checkpoint.path}}, checkpoint


def _referenced_checkpoint(reference: str, owner) -> tuple[Checkpoint | None, str]:
    yours = Checkpoint.objects.filter(run__owner=owner) if owner is not None else Checkpoint.objects.none()
    if match := CHECKPOINT_REFERENCE.match(reference):
        found, missing = yours.filter(pk=int(match[1])), f"you have no checkpoint {match[1]}"
    elif match := RUN_STEP_REFERENCE.match(reference):
        found = yours.filter(run_id=int(match[1]), step=int(match[2]), state=COMMITTED).order_by("-id")
        missing = f"you have no run {match[1]} with a committed checkpoint at step {match[2]}"
    else:
        return None, f"cannot be a path: the platform places checkpoints; name one by reference: {RESUME_REFERENCES}"
    checkpoint = found.first()
    if checkpoint is None:
        return None, missing
    if checkpoint.state != COMMITTED:
        return None, f"checkpoint {checkpoint.pk} is {checkpoint.state} ({checkpoint.problem}); choose a committed one"
    return checkpoint, ""


def estimate_error_key(field: str) -> str:
    return field if field.startswith("cluster") else f"config.{field}"


def create_run(owner, name, document, cluster=None) -> Run:
    """Validate, store the run with its first attempt (and, given a cluster, its estimate on it),
    and queue the launch once committed."""

    clean_name, config, estimate, source, sources = validate_run_input(name, document, cluster, owner)
    if errors := launch_limit_errors(config):
        raise RunInputError(errors)
    with transaction.atomic():
        # Two runs created at once by one owner are counted against the owner's limits one after the other.
        get_user_model().objects.select_for_update().filter(pk=owner.pk).first()
        if errors := owner_limit_errors(owner, config):
            raise RunInputError(errors)
        # A run that resumes from a checkpoint of another run is that run's fork, in its lineage from the start.
        run = Run.objects.create(
            owner=owner,
            name=clean_name,
            config=config,
            estimate=estimate,
            forked_from=source,
            dataset=sources.dataset,
            pretrained=sources.pretrained,
        )
        queue_attempt(run, config, Attempt.CREATED, source=source)
    return run


def queue_attempt(run: Run, config: dict, trigger: str, note: str = "", source=None, avoid_nodes=()) -> Attempt:
    """Add the run's next attempt, queued, resuming from the checkpoint `source` (null: as its config
    says), away from `avoid_nodes`, and launch it once committed. Call inside a transaction."""
    from loom.telemetry.services import record_platform_event

    number = (run.attempts.order_by("-number").values_list("number", flat=True).first() or 0) + 1
    attempt = Attempt.objects.create(
        run=run,
        number=number,
        config=config,
        trigger=trigger,
        trigger_note=note,
        restored_from=source,
        launch_sent_at=timezone.now(),
        avoid_nodes=list(avoid_nodes),
    )
    mirror_on_run(attempt)
    payload = {"state": states.QUEUED, "attempt": number, "trigger": trigger}
    if note:
        payload["note"] = note
    if source is not None:
        payload |= {"checkpoint": source.pk, "step": source.step}
    record_platform_event(run, attempt, "state", payload)
    # robust: an unreachable broker must not turn a stored run into an error response; the reconciler sends
    # the launch again once the attempt has waited LOOM_RELAUNCH_AFTER_S. By name: the tasks sit above this module.
    transaction.on_commit(lambda: send_launch(attempt.pk), robust=True)
    return attempt


def send_launch(attempt_id: int) -> None:
    """Hand the attempt's launch message to the broker, by task name: the tasks import this module."""
    current_app.send_task(LAUNCH_TASK, args=[attempt_id])


def runs_for(user):
    return Run.objects.filter(owner=user)


def run_for(user, run_id: int) -> Run:
    """The user's run, or 404: someone else's run is indistinguishable from a missing one."""
    run = Run.objects.filter(owner=user, pk=run_id).first()
    if run is None:
        raise Http404("no such run")
    return run


TAG = re.compile(r"^[a-z0-9][a-z0-9._:/-]{0,39}$")
TAGS_MAX = 20
TAG_RULE = (
    f"a tag is 1 to 40 letters, digits and . _ : / - (kept in lower case, starting with a letter or digit), "
    f"at most {TAGS_MAX} a run"
)
NOTE_MAX = 10_000


def edit_run(run: Run, *, name=None, tags=None, note=None, archived=None) -> Run:
    """Rename a run, replace its tags, write its note, archive or restore it; None leaves that as it is. A bad
    field changes nothing: RunInputError names each."""
    errors = name_errors(name) if name is not None else {}
    clean_tags = []
    for tag in tags or []:
        clean = tag.strip().lower()
        if not TAG.match(clean):
            errors.setdefault("tags", f"{tag!r} is not a tag: {TAG_RULE}")
        elif clean not in clean_tags:
            clean_tags.append(clean)
    if len(clean_tags) > TAGS_MAX:
        errors.setdefault("tags", f"{len(clean_tags)} tags are too many: {TAG_RULE}")
    if note is not None and len(note) > NOTE_MAX:
        errors["note"] = f"must be at most {NOTE_MAX:,} characters"
    if errors:
        raise RunInputError(errors)
    with transaction.atomic():
        # Two edits at once replace the tags one after the other, never both deleting and adding them.
        run = Run.objects.select_for_update().get(pk=run.pk)
        changed = ["updated_at"]
        if name is not None:
            run.name = name.strip()
            changed.append("name")
        if note is not None:
            run.note = note
            changed.append("note")
        if archived is not None and archived != (run.archived_at is not None):
            run.archived_at = timezone.now() if archived else None
            changed.append("archived_at")
        if tags is not None:
            run.tags.all().delete()
            RunTag.objects.bulk_create([RunTag(run=run, name=tag) for tag in clean_tags])
        run.save(update_fields=changed)
    return run


def latest_attempt(run: Run) -> Attempt:
    return run.attempts.order_by("-number").first()


def cancel_run(run: Run) -> Run:
    """Cancel the latest attempt: at once if it has not started, else ask its launcher to stop it."""
    from loom.telemetry.services import record_platform_event

    with transaction.atomic():
        attempt = locked_attempt(latest_attempt(run).pk)
        if attempt.state in states.TERMINAL:
            raise RunConflict(f"run already {attempt.state}")
        if attempt.state == states.CANCELLING:
            return run
        target = states.CANCELLED if attempt.state == states.QUEUED else states.CANCELLING
        attempt.cancel_requested = True
        attempt.save(update_fields=["cancel_requested"])
        move_attempt(attempt, target, reason="cancelled by user")
        record_platform_event(run, attempt, "state", {"state": target, "attempt": attempt.number})
        if target == states.CANCELLING:
            # The reconciler asks the backend again every pass; this only makes the first ask immediate.
            transaction.on_commit(lambda: current_app.send_task(CANCEL_TASK, args=[attempt.pk]), robust=True)
    run.refresh_from_db()
    return run


def locked_attempt(attempt_id: int) -> Attempt:
    """The attempt under a row lock, its run's row locked first: every writer of a run's events takes the run's
    row (the seq counter) before its attempt's, so two writers never wait on each other in opposite orders.
    Call inside a transaction."""
    run_id = Attempt.objects.values_list("run_id", flat=True).get(pk=attempt_id)
    Run.objects.select_for_update().filter(pk=run_id).exists()
    return Attempt.objects.select_for_update().select_related("run").get(pk=attempt_id)


def move_attempt(
    attempt: Attempt, target: str, *, exit_code=None, reason: str = "", failure_kind: str = "", retryable=None
) -> None:
    """Apply a state transition to an attempt and mirror it on its run if it is the latest. What an end means
    beyond that (alerts, a restart) is loom.runs.lifecycle's to decide."""
    states.check_transition(attempt.state, target)
    attempt.state = target
    fields = ["state"]
    now = timezone.now()
    if target == states.RUNNING and attempt.started_at is None:
        attempt.started_at = now
        fields.append("started_at")
    if target in states.TERMINAL:
        attempt.finished_at = now
        attempt.exit_code = exit_code
        fields += ["finished_at", "exit_code"]
    if reason and target != states.SUCCEEDED:
        attempt.failure_reason = reason[:4000]
        fields.append("failure_reason")
    if target == states.FAILED:
        attempt.failure_kind = failure_kind
        attempt.retryable = retryable
        fields += ["failure_kind", "retryable"]
    attempt.save(update_fields=fields)
    mirror_on_run(attempt)


def mirror_on_run(attempt: Attempt) -> None:
    """A run's state is its latest attempt's state."""
    if not Attempt.objects.filter(run_id=attempt.run_id, number__gt=attempt.number).exists():
        Run.objects.filter(pk=attempt.run_id).update(state=attempt.state, updated_at=timezone.now())
