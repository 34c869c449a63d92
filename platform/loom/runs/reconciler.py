"""Runs always end: every pass compares each active attempt with its launch backend and acts on the
difference, whatever process died on the way (the worker that launched it, the supervisor, a web process).

- queued too long: its launch message is sent again (an outbox; claiming makes a second delivery a no-op);
- starting with no handle long after it was claimed: the launch died before submitting; it fails as worker_lost;
- the backend runs it: it is marked running, with its nodes; pending: the backend's reason is shown;
- cancelling: the backend is told to stop it again (idempotent), until it is gone;
- the backend says it is gone: it ends as the backend and its logs say (lifecycle.end_attempt, exactly once).

A pass is idempotent and safe beside another one: every change is a conditional update or goes through the
lifecycle's row-locked end, so two reconcilers and a late supervisor never record one end twice."""

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.utils import timezone

from loom.operations.services import RECONCILE, record_pass
from loom.operations.structured_logs import run_context
from loom.telemetry.models import Event
from trainer.config import world_size_of

from . import states
from .backends import ENDED, PENDING, RUNNING, Observation, backend_named
from .failures import WORKER_LOST, Failure, classify
from .lifecycle import Ending, end_attempt, mark_running, note_pending
from .models import Attempt

log = logging.getLogger(__name__)

# A claimed attempt gets its handle within seconds (sbatch, a fork); one without after this long was orphaned
# by a launch that died between claiming and submitting.
SUBMIT_DEADLINE_S = 120.0


@dataclass
class Pass:
    relaunched: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    ended: list[int] = field(default_factory=list)
    cancels_sent: list[int] = field(default_factory=list)


def reconcile(send_launch) -> Pass:
    """One pass over every active attempt. `send_launch(attempt_id)` hands a launch message to the broker."""
    done = Pass()
    _resend_stale_launches(send_launch, done)
    _fail_orphaned_claims(done)
    active = list(
        Attempt.objects.filter(state__in=states.ACTIVE - {states.QUEUED}, backend_handle__isnull=False).only(
            "id",
            "run_id",
            "state",
            "backend",
            "backend_handle",
            "cancel_requested",
            "work_dir",
            "pending_reason",
            "nodes",
        )  # fmt: skip
    )
    by_backend: dict[str, list[Attempt]] = {}
    for attempt in active:
        by_backend.setdefault(attempt.backend or "local", []).append(attempt)
    for name, attempts in by_backend.items():
        backend = backend_named(name)
        observations = backend.observe({attempt.pk: attempt.backend_handle for attempt in attempts})
        for attempt in attempts:
            with run_context(attempt.run_id, attempt.pk):
                _act(backend, attempt, observations.get(attempt.pk), done)
    # Only a pass that got here counts: one that raised leaves the lag growing, which is what operators watch.
    record_pass(RECONCILE)
    return done


def _resend_stale_launches(send_launch, done: Pass) -> None:
    now = timezone.now()
    stale_before = now - timedelta(seconds=settings.LOOM_RELAUNCH_AFTER_S)
    waiting = Attempt.objects.filter(state=states.QUEUED, token_hash="", launch_sent_at__lt=stale_before)
    for attempt_id, run_id, sent_at in waiting.values_list("id", "run_id", "launch_sent_at"):
        with run_context(run_id, attempt_id):
            _resend_launch(send_launch, attempt_id, sent_at, now, done)


def _resend_launch(send_launch, attempt_id: int, sent_at, now, done: Pass) -> None:
    # Only the pass whose update moves launch_sent_at on sends: two reconcilers never both do.
    if not Attempt.objects.filter(pk=attempt_id, state=states.QUEUED, launch_sent_at=sent_at).update(
        launch_sent_at=now
    ):
        return
    try:
        send_launch(attempt_id)
    except Exception as error:  # the broker still down: the next pass tries again
        log.warning("could not send the launch of attempt %s again: %s", attempt_id, error)
        Attempt.objects.filter(pk=attempt_id, launch_sent_at=now).update(launch_sent_at=sent_at)
        return
    done.relaunched.append(attempt_id)


def _fail_orphaned_claims(done: Pass) -> None:
    deadline = timezone.now() - timedelta(seconds=SUBMIT_DEADLINE_S)
    orphaned = Attempt.objects.filter(
        state__in=(states.STARTING, states.CANCELLING), backend_handle__isnull=True, launch_sent_at__lt=deadline
    ).exclude(token_hash="")
    for attempt in orphaned:
        if attempt.cancel_requested:
            ending = Ending(states.CANCELLED, reason="cancelled by user")
        else:
            why = "the worker launching this attempt stopped before it handed the attempt to the launch backend"
            ending = Ending(states.FAILED, reason=why, failure=Failure(WORKER_LOST, why))
        with run_context(attempt.run_id, attempt.pk):
            if end_attempt(attempt.pk, ending):
                done.ended.append(attempt.pk)


def _act(backend, attempt: Attempt, observation: Observation | None, done: Pass) -> None:
    if observation is None or observation.state not in (PENDING, RUNNING, ENDED):
        return
    if observation.state == ENDED:
        if end_attempt(attempt.pk, ending_of(attempt, observation)):
            done.ended.append(attempt.pk)
        return
    if attempt.cancel_requested:
        backend.cancel(attempt.backend_handle, settings.LOOM_CANCEL_GRACE_S)
        done.cancels_sent.append(attempt.pk)
    if observation.state == PENDING:
        if attempt.pending_reason != observation.pending_reason:
            note_pending(attempt.pk, observation.pending_reason)
        return
    if attempt.state == states.STARTING or not set(observation.nodes) <= set(attempt.nodes) or attempt.pending_reason:
        if mark_running(attempt.pk, list(observation.nodes)):
            done.running.append(attempt.pk)


def ending_of(attempt: Attempt, observation: Observation) -> Ending:
    """How the attempt ended, from the backend's account and what torchrun left in its work dir."""
    exit_code = observation.exit_code
    if attempt.cancel_requested:
        return Ending(states.CANCELLED, exit_code, "cancelled by user")
    if observation.backend_failure is None and exit_code == 0:
        return Ending(states.SUCCEEDED, exit_code)
    from_logs = classify(Path(attempt.work_dir)) if attempt.work_dir else None
    if observation.backend_failure is not None:
        kind, why = observation.backend_failure
        if kind == "lost":
            kind = WORKER_LOST
            # Nobody saw torchrun's exit, but every rank said it finished: it ran to the end.
            if _every_rank_finished(attempt):
                return Ending(states.SUCCEEDED, exit_code, f"{why}; every rank reported it finished")
        # The ranks' own evidence (a rank killed, an exception) names the cause better when there is some.
        if from_logs is not None and from_logs.rank is not None and kind == WORKER_LOST:
            return Ending(states.FAILED, exit_code, f"{why}\n{from_logs.reason}", from_logs)
        return Ending(states.FAILED, exit_code, why, Failure(kind, why))
    failure = from_logs or Failure("unknown", "")
    return Ending(states.FAILED, exit_code, f"torchrun exited with code {exit_code}\n{failure.reason}", failure)


def _every_rank_finished(attempt: Attempt) -> bool:
    finished = Event.objects.filter(attempt_id=attempt.pk, kind="state", rank__gte=0, payload__state="finished")
    ranks = set(finished.values_list("rank", flat=True))
    return ranks == set(range(world_size_of(attempt.config)))
