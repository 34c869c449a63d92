"""Checkpoints as the platform knows them: filled from the trainer's `checkpoint` events, drawn as a
lineage across runs and attempts, pinned against retention, and restored into a new attempt or a forked run."""

import logging
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from django.db import transaction
from django.db.models import Max
from django.http import Http404

from loom.runs import services as run_services
from loom.runs import states
from loom.runs.models import Attempt, Run
from loom.telemetry.models import Event
from trainer.config import ConfigError, parse_config, world_size_of

from .models import COMMITTED, CORRUPT, DELETED, Checkpoint, Pin

RESTORE_MODES = ("attempt", "fork")
CHECKPOINTS_DIR_NAME = "checkpoints"

log = logging.getLogger(__name__)


def checkpoint_dir_for(work_dir: Path) -> Path:
    """Where an attempt writes its checkpoints: a directory of its own work dir, which the platform derives from
    the run's and the attempt's ids (runs/launcher.py). A config cannot name another: a restore from an earlier
    step never overwrites or retires another attempt's checkpoints, and nobody writes into someone else's."""
    return Path(work_dir) / CHECKPOINTS_DIR_NAME


def record_checkpoint_event(attempt: Attempt, event) -> None:
    """Apply one stored `checkpoint` event (committed, loaded, corrupt, deleted; failed saves stay
    events only). Called inside the ingest transaction, so the row and the event land together.

    An attempt's token speaks for its own run only: a commit lies in the attempt's own checkpoint directory,
    corrupt and deleted mark only its run's checkpoints (a trainer reports them only from a directory it
    searched: its own, or on a restart its run's previous attempt's), and a load names a checkpoint of its
    owner's. Anything else is ignored with a warning; the event stays stored."""
    payload = event.payload
    path = payload.get("path")
    if not isinstance(path, str) or not path:
        return
    state = payload.get("state")
    if state == COMMITTED:
        _record_commit(attempt, event, path)
    elif state in (CORRUPT, DELETED):
        _record_problem(attempt, state, path, payload.get("error") or f"deleted by {attempt} (retention)")
    elif state == "loaded":
        source = _owners_checkpoints(attempt).filter(path=path).order_by("-id").first()
        if source is None:
            # Initial weights may be an imported model's (the run's `pretrained` link already names it).
            if not payload.get("initial"):
                log.warning("%s reported loading %s, which is no checkpoint of its owner's; ignored", attempt, path)
            return
        Attempt.objects.filter(pk=attempt.pk).update(restored_from=source)


def _owners_checkpoints(attempt: Attempt):
    return Checkpoint.objects.filter(run__owner_id=attempt.run.owner_id)


def _record_problem(attempt: Attempt, state: str, path: str, problem) -> None:
    mine = Checkpoint.objects.filter(run_id=attempt.run_id, path=path)
    marked = mine.exclude(state=DELETED).update(state=state, problem=str(problem)[:4000])
    if not marked and Checkpoint.objects.filter(path=path).exclude(run_id=attempt.run_id).exists():
        log.warning("%s reported %s %s, a checkpoint of another run; ignored", attempt, state, path)


def _in_own_directory(attempt: Attempt, path: str) -> bool:
    """Whether `path` names an entry directly inside the attempt's checkpoint directory (`..` taken out first)."""
    if not attempt.work_dir:
        return False
    own = os.path.normpath(checkpoint_dir_for(Path(attempt.work_dir)))
    return os.path.dirname(os.path.normpath(path)) == own


def _record_commit(attempt: Attempt, event, path: str) -> None:
    if not _in_own_directory(attempt, path):
        log.warning(
            "%s reported committing %s, outside its checkpoint directory %s; ignored",
            attempt,
            path,
            checkpoint_dir_for(Path(attempt.work_dir)) if attempt.work_dir else "(not launched yet)",
        )
        return
    payload = event.payload
    # A later save of the same step into the same directory replaced the older one on disk.
    replaced = f"replaced by a save of attempt {attempt.number} under the same name"
    Checkpoint.objects.filter(run_id=attempt.run_id, path=path, state=COMMITTED).update(state=DELETED, problem=replaced)
    parent_path = payload.get("parent")
    parent = _owners_checkpoints(attempt).filter(path=parent_path).order_by("-id").first() if parent_path else None
    Checkpoint.objects.create(
        run_id=attempt.run_id,
        attempt=attempt,
        step=int(payload.get("step") or event.step or 0),
        path=path,
        bytes=int(payload.get("bytes") or 0),
        layout=payload.get("layout") or {},
        world_size=int(payload.get("world_size") or 1),
        parent=parent,
        loss=payload.get("loss"),
        stall_s=payload.get("stall_s"),
        save_s=payload.get("save_s"),
        committed_at=event.time,
    )


def checkpoints_of(run: Run):
    return Checkpoint.objects.filter(run=run).select_related("attempt", "parent").order_by("step", "id")


def latest_committed(attempt: Attempt) -> Checkpoint | None:
    return Checkpoint.objects.filter(attempt=attempt, state=COMMITTED).order_by("-step", "-id").first()


def last_before(checkpoints: Sequence[Checkpoint], step: int) -> Checkpoint | None:
    """The checkpoint to restore from past something first seen at `step`: the last of `checkpoints`
    (committed, by step) saved before it. One saved at the step itself already holds that step's update."""
    before = [checkpoint for checkpoint in checkpoints if checkpoint.step < step]
    return before[-1] if before else None


def restore_point_for(alert, committed: Sequence[Checkpoint]) -> Checkpoint | None:
    """The checkpoint triage offers to restore from after `alert`, and the one the alert pins while it is live:
    the last saved before its step; for overfitting, the last saved at or before its lowest validation loss
    (the first evaluation of the rise), where the model generalised best."""
    from loom.alerts.detectors import OVERFIT

    if alert.rule == OVERFIT and alert.details.get("steps"):
        return last_before(committed, alert.details["steps"][0] + 1)
    return last_before(committed, alert.step)


# Pins: what retention must keep.


def pins_of(run: Run) -> dict[int, list[str]]:
    """Why each pinned checkpoint of the run is pinned, by checkpoint id: each live alert pins the one
    triage offers to restore from past it (restore_point_for, of any attempt of the run) for as long
    as it is live, and a person pins any committed one until they unpin it."""
    from loom.alerts.models import Alert

    committed = list(Checkpoint.objects.filter(run=run, state=COMMITTED).order_by("step", "id"))
    reasons: dict[int, list[str]] = defaultdict(list)
    for alert in Alert.objects.filter(run=run, state__in=Alert.LIVE).order_by("id"):
        restore_point = restore_point_for(alert, committed)
        if restore_point is not None:
            what = alert.rule.replace("_", " ")
            reasons[restore_point.pk].append(f"pinned by alert #{alert.pk} ({what} at step {alert.step})")
    pins = Pin.objects.filter(checkpoint__run=run, checkpoint__state=COMMITTED).select_related("pinned_by")
    for pin in pins.order_by("id"):
        reasons[pin.checkpoint_id].append(f"pinned by {pin.pinned_by.get_username()}")
    return dict(reasons)


def with_pins(run: Run, checkpoints) -> list[Checkpoint]:
    """The checkpoints, each with `pins` (why it is pinned; empty: it is not) and `user_pinned` (whether a
    person pinned it, which unpinning takes back)."""
    reasons = pins_of(run)
    checkpoints = list(checkpoints)
    user_pinned = set(Pin.objects.filter(checkpoint__in=checkpoints).values_list("checkpoint_id", flat=True))
    for checkpoint in checkpoints:
        checkpoint.pins = reasons.get(checkpoint.pk, [])
        checkpoint.user_pinned = checkpoint.pk in user_pinned
    return checkpoints


def pinned_paths(run: Run) -> dict[str, list[str]]:
    """The run's pinned checkpoints by path, with why: what its attempts' retention must not delete."""
    reasons = pins_of(run)
    paths = Checkpoint.objects.filter(pk__in=reasons).values_list("pk", "path")
    return {path: reasons[pk] for pk, path in paths}


def _checkpoint_of(run: Run, checkpoint_id: int) -> Checkpoint:
    checkpoint = Checkpoint.objects.filter(run=run, pk=checkpoint_id).first()
    if checkpoint is None:
        raise Http404(f"run {run.pk} has no checkpoint {checkpoint_id}")
    return checkpoint


def pin(user, run: Run, checkpoint_id: int) -> Checkpoint:
    """Keep a committed checkpoint of the user's run past retention until they unpin it."""
    checkpoint = _checkpoint_of(run, checkpoint_id)
    if checkpoint.state != COMMITTED:
        raise run_services.RunInputError(
            {"checkpoint": f"is {checkpoint.state} ({checkpoint.problem}); only a committed one can be pinned"}
        )
    Pin.objects.get_or_create(checkpoint=checkpoint, pinned_by=user)
    return with_pins(run, [checkpoint])[0]


def unpin(user, run: Run, checkpoint_id: int) -> Checkpoint:
    """Take back the user's pin; an alert's pin stays until the alert is resolved."""
    checkpoint = _checkpoint_of(run, checkpoint_id)
    Pin.objects.filter(checkpoint=checkpoint, pinned_by=user).delete()
    return with_pins(run, [checkpoint])[0]


# Lineage.


def family_of(run: Run) -> list[Run]:
    """The run, the run it was forked from and so on up, and every run forked from any of them; when the root
    started from an imported model, every run of the owner's started from that model is a root too."""
    root = run
    while root.forked_from_id is not None:
        root = Run.objects.select_related("forked_from__run").get(pk=root.pk).forked_from.run
    roots = [root]
    if root.pretrained_id is not None:
        siblings = Run.objects.filter(owner_id=run.owner_id, pretrained_id=root.pretrained_id, forked_from=None)
        roots = list(siblings.order_by("id"))
    family, frontier = list(roots), list(roots)
    while frontier:
        children = list(Run.objects.filter(forked_from__run__in=frontier, owner_id=run.owner_id).order_by("id"))
        family += children
        frontier = children
    return family


def lineage(run: Run) -> dict:
    """The DAG of a run's family: the imported models its roots started from, runs, their attempts (each with
    the checkpoint it started from) and their checkpoints (each with its parent), ids throughout so a page can
    draw the edges."""
    family = family_of(run)
    attempts = Attempt.objects.filter(run__in=family).order_by("run_id", "number")
    checkpoints = Checkpoint.objects.filter(run__in=family).order_by("run_id", "step", "id")
    trained = Event.objects.filter(run__in=family, kind="metric").values("attempt_id").annotate(last=Max("step"))
    last_steps = {row["attempt_id"]: row["last"] for row in trained}
    models = {r.pretrained for r in family if r.pretrained_id is not None and r.forked_from_id is None}
    return {
        "run": run.pk,
        "models": [
            {"id": model.pk, "name": model.name, "source_path": model.source_path, "reference": model.reference}
            for model in sorted(models, key=lambda model: model.pk)
        ],
        "runs": [
            {
                "id": r.pk,
                "name": r.name,
                "state": r.state,
                "forked_from": r.forked_from_id,
                "pretrained": r.pretrained_id,
            }
            for r in family
        ],
        "attempts": [attempt_node(attempt, last_steps.get(attempt.pk)) for attempt in attempts],
        "checkpoints": [checkpoint_node(checkpoint) for checkpoint in checkpoints],
    }


def attempt_node(attempt: Attempt, last_step: int | None) -> dict:
    return {
        "id": attempt.pk,
        "last_step": last_step,
        "run": attempt.run_id,
        "number": attempt.number,
        "state": attempt.state,
        "trigger": attempt.trigger,
        "trigger_note": attempt.trigger_note,
        "restored_from": attempt.restored_from_id,
        "failure_kind": attempt.failure_kind,
        "failure": attempt.failure_reason.splitlines()[:2],
        "restart_decision": attempt.restart_decision,
        "world_size": world_size_of(attempt.config),
    }


def checkpoint_node(checkpoint: Checkpoint) -> dict:
    return {
        "id": checkpoint.pk,
        "run": checkpoint.run_id,
        "attempt": checkpoint.attempt_id,
        "step": checkpoint.step,
        "state": checkpoint.state,
        "parent": checkpoint.parent_id,
        "path": checkpoint.path,
        "bytes": checkpoint.bytes,
        "layout": checkpoint.layout,
        "world_size": checkpoint.world_size,
        "loss": checkpoint.loss,
        "stall_s": checkpoint.stall_s,
        "save_s": checkpoint.save_s,
        "problem": checkpoint.problem,
        "committed_at": checkpoint.committed_at.isoformat(),
    }


# Restoring.


def resumed_config(
    config: dict, resume: str | None, parallel: dict | None = None, steps=None, lr=None, skip_steps=None
) -> dict:
    """The validated config, defaults filled in, of an attempt that resumes from `resume` (a checkpoint,
    or a directory of them), in another layout when `parallel` is given, with another peak learning rate
    (`lr`) and one more range of steps whose data it skips (`skip_steps`, [first, last]) when given;
    ConfigError says what is wrong. Injected faults rehearse one failure: the attempt that recovers from
    it runs without them. `resume` is a path the platform chose; where the attempt writes is the launcher's to say,
    so a directory in `config` (stored before the platform refused them) is dropped."""
    checkpoint = {**config.get("checkpoint", {}), "resume": resume, "directory": None}
    document = {**config, "checkpoint": checkpoint, "faults": {}}
    if parallel is not None:
        document["parallel"] = {**config.get("parallel", {}), **parallel}
    if steps is not None:
        document["steps"] = steps
    if lr is not None:
        document["optimizer"] = {**config.get("optimizer", {}), "lr": lr}
    if skip_steps is not None:
        data = config.get("data", {})
        document["data"] = {**data, "skip_steps": [*data.get("skip_steps", []), skip_steps]}
    return parse_config(document).model_dump(mode="json")


def restore(
    user,
    run: Run,
    checkpoint_id,
    mode: str = "attempt",
    parallel: dict | None = None,
    steps=None,
    name: str | None = None,
    lr=None,
    skip_steps=None,
) -> Attempt:
    """Start from a committed checkpoint of the run, as its next attempt or as the first attempt of a
    new run forked from it, optionally in another layout; errors are keyed by field and change nothing."""
    errors: dict[str, str] = {}
    checkpoint = None
    if not isinstance(checkpoint_id, int) or isinstance(checkpoint_id, bool):
        errors["checkpoint"] = "is required: the id of one of this run's committed checkpoints"
    else:
        checkpoint = Checkpoint.objects.select_related("attempt").filter(run=run, pk=checkpoint_id).first()
        if checkpoint is None:
            errors["checkpoint"] = f"run {run.pk} has no checkpoint {checkpoint_id}"
        elif checkpoint.state != COMMITTED:
            errors["checkpoint"] = f"is {checkpoint.state} ({checkpoint.problem}); choose a committed one"
    if mode not in RESTORE_MODES:
        errors["mode"] = f"must be one of {', '.join(RESTORE_MODES)}"
    elif mode == "attempt":
        latest = run_services.latest_attempt(run)
        if latest.state in states.ACTIVE:
            errors["mode"] = (
                f"run {run.pk} is still {latest.state} (attempt {latest.number}); cancel it first, or fork a new run"
            )
    if parallel is not None and not isinstance(parallel, dict):
        errors["config.parallel"] = "must be an object of parallel fields (tp, pp, dp_shard, …)"
    if mode == "fork" and name is not None and (not isinstance(name, str) or not name.strip()):
        errors["name"] = "must not be blank"
    if errors:
        raise run_services.RunInputError(errors)
    try:
        config = resumed_config(checkpoint.attempt.config, checkpoint.path, parallel, steps, lr, skip_steps)
    except ConfigError as error:
        errors = {f"config.{field}": message for field, message in error.errors.items()}
        raise run_services.RunInputError(errors) from None
    if mode == "fork":
        return _fork(user, run, checkpoint, config, (name or f"{run.name} from step {checkpoint.step}").strip())
    note = f"restored from step {checkpoint.step} (attempt {checkpoint.attempt.number}) by {user}"
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        return run_services.queue_attempt(locked, config, Attempt.RESTORE, note, checkpoint)


def _fork(user, run: Run, checkpoint: Checkpoint, config: dict, name: str) -> Attempt:
    with transaction.atomic():
        # It trains on what its origin trained on (the config's dataset reference is the same one).
        fork = Run.objects.create(
            owner=user, name=name[:200], config=config, forked_from=checkpoint, dataset_id=run.dataset_id
        )
        note = f"forked from run {run.pk} at step {checkpoint.step} (attempt {checkpoint.attempt.number})"
        return run_services.queue_attempt(fork, config, Attempt.RESTORE, note, checkpoint)
