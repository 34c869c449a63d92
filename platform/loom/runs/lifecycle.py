"""The one owner of what happens to an attempt.

Whatever reports it — the launch task (started, running), the ranks' stored events (checkpoint commits, the
launcher's state events), the reconciler (the process or job is gone, how it ended), a person (cancel) — this
module moves the attempt, ends it exactly once, raises its exit alert, asks the restart policy (a pure function,
restart_policy.py) and queues the next attempt. Storage, alerts and checkpoints never call back up into it:
telemetry's store announces what it stored (events_stored) and this module listens.
"""

import logging
from dataclasses import dataclass

from django.db import transaction

from loom.alerts.notify import announce
from loom.alerts.services import end_live_conditions, record_exit
from loom.checkpoints.models import Checkpoint
from loom.checkpoints.services import latest_committed, record_checkpoint_event, resumed_config
from loom.telemetry.services import LAUNCHER_RANK, record_platform_event

from . import restart_policy, states
from .backends import backend_named
from .failures import NODE_FAILURE, Failure
from .models import Attempt
from .nodes import BackendUnavailable, exclude_node, failures_on, reported_nodes
from .services import locked_attempt, move_attempt, queue_attempt

log = logging.getLogger(__name__)

DEFAULT_EXCLUDE_AFTER_FAILURES = 2


@dataclass(frozen=True)
class Ending:
    """How an attempt ended, as whoever saw it end tells it."""

    outcome: str  # SUCCEEDED, FAILED or CANCELLED
    exit_code: int | None = None
    reason: str = ""
    failure: Failure | None = None


def on_events_stored(events, **_) -> None:
    """Receiver of loom.telemetry.store.events_stored, inside the storing transaction: checkpoint events fill
    the lineage, the launcher's state events move the attempt."""
    special = [
        event
        for event in events
        if event.kind == "checkpoint" or (event.kind == "state" and event.rank == LAUNCHER_RANK)
    ]
    if not special:
        return
    attempts = Attempt.objects.select_related("run").in_bulk({event.batch.attempt_id for event in special})
    for event in special:
        attempt = attempts[event.batch.attempt_id]
        if event.kind == "checkpoint":
            record_checkpoint_event(attempt, event.as_model())
        else:
            _apply_reported_state(attempt, event.payload)


def _apply_reported_state(attempt: Attempt, payload: dict) -> None:
    target = payload.get("state")
    attempt.refresh_from_db()
    if target == attempt.state:
        return
    try:
        states.check_transition(attempt.state, target)
    except ValueError as error:
        log.warning("launcher reported state %r for %s, kept %s: %s", target, attempt, attempt.state, error)
        return
    if target in states.TERMINAL:
        failure = None
        if target == states.FAILED:
            failure = Failure(
                payload.get("failure_kind", ""),
                str(payload.get("failure_cause") or payload.get("reason", "")),
                payload.get("failure_rank"),
            )
        ending = Ending(target, payload.get("exit_code"), payload.get("reason", ""), failure)
        end_attempt(attempt.pk, ending, record_event=False)
    else:
        move_attempt(attempt, target)


def end_attempt(attempt_id: int, ending: Ending, *, record_event: bool = True) -> bool:
    """End the attempt as `ending` says, once: False, and nothing done, if it had already ended (a late
    supervisor and the reconciler may both see the same end). With it end the alerts only a running attempt
    can have; a failure raises the exit alert and goes to the restart policy. `record_event` is False when
    the end arrived as a stored state event already."""
    with transaction.atomic():
        attempt = locked_attempt(attempt_id)
        if attempt.state in states.TERMINAL:
            return False
        failure = ending.failure
        if attempt.state == states.STARTING and ending.outcome == states.SUCCEEDED:
            # It ran between two looks at its backend.
            move_attempt(attempt, states.RUNNING)
        move_attempt(
            attempt,
            ending.outcome,
            exit_code=ending.exit_code,
            reason=ending.reason,
            failure_kind=failure.kind if failure else "",
            retryable=failure.retryable if failure else None,
        )
        if record_event:
            payload = {"attempt": attempt.number, "state": ending.outcome, "exit_code": ending.exit_code}
            if ending.reason:
                payload["reason"] = ending.reason
            if failure is not None and ending.outcome == states.FAILED:
                payload |= {"failure_kind": failure.kind, "retryable": failure.retryable, "failure_rank": failure.rank}
            record_platform_event(attempt.run, attempt, "state", payload)
        announce(end_live_conditions(attempt))
        if ending.outcome == states.FAILED:
            cause = failure.reason.partition("\n")[0] if failure else ""
            announce(record_exit(attempt, failure.rank if failure else None, cause))
            failed_nodes = _judge_failed_nodes(attempt) if failure and failure.kind == NODE_FAILURE else []
            restart_after_failure(attempt, avoid_nodes=failed_nodes)
    return True


def _judge_failed_nodes(attempt: Attempt) -> list[str]:
    """The attempt's nodes its backend now reports unhealthy. Each counts one more node failure against the node;
    at restart.exclude_after_failures it is excluded from every later launch until someone includes it again."""
    backend = backend_named(attempt.backend or "local")
    try:
        unhealthy = {node.name for node in reported_nodes(backend) if not node.usable}
    except BackendUnavailable as error:
        log.warning("%s failed on a node, and its backend could not say which: %s", attempt, error)
        return []
    failed = sorted(unhealthy & set(attempt.nodes))
    limit = attempt.config.get("restart", {}).get("exclude_after_failures", DEFAULT_EXCLUDE_AFTER_FAILURES)
    for name in failed:
        count = failures_on(backend, name).get(NODE_FAILURE, 0)
        if limit and count >= limit:
            reason = (
                f"{count} attempts failed on it by node failures, the last {attempt} (restart.exclude_after_failures)"
            )
            exclude_node(backend, name, reason)
    return failed


def restart_after_failure(attempt: Attempt, avoid_nodes: list[str] = ()) -> Attempt | None:
    """Ask the restart policy, record its decision on the failed attempt, and queue the restart if there is one,
    away from `avoid_nodes`."""
    decision = restart_policy.decide(_facts(attempt))
    restart = None
    summary = decision.summary
    if decision.restart is not None:
        plan = decision.restart
        source = Checkpoint.objects.filter(pk=plan.source.id).first() if plan.source else None
        config = resumed_config(attempt.config, plan.resume)
        restart = queue_attempt(attempt.run, config, Attempt.RESTART, plan.note, source, avoid_nodes=list(avoid_nodes))
        summary = summary.format(number=restart.number)
        if avoid_nodes:
            summary += f", away from {', '.join(avoid_nodes)}"
    Attempt.objects.filter(pk=attempt.pk).update(restart_decision=summary)
    attempt.restart_decision = summary
    return restart


def _facts(attempt: Attempt) -> restart_policy.FailedAttempt:
    newest = latest_committed(attempt)
    restored = attempt.restored_from
    return restart_policy.FailedAttempt(
        number=attempt.number,
        retryable=attempt.retryable,
        failure_kind=attempt.failure_kind,
        failure_reason=attempt.failure_reason,
        max_restarts=attempt.config.get("restart", {}).get("max_restarts", restart_policy.DEFAULT_MAX_RESTARTS),
        restarts_in_a_row=restarts_in_a_row(attempt),
        later_attempt_exists=attempt.run.attempts.filter(number__gt=attempt.number).exists(),
        newest_committed=_ref(newest),
        restored_from=_ref(restored),
        configured_resume=attempt.config.get("checkpoint", {}).get("resume"),
    )


def _ref(checkpoint: Checkpoint | None) -> restart_policy.CheckpointRef | None:
    return restart_policy.CheckpointRef(checkpoint.pk, checkpoint.step, checkpoint.path) if checkpoint else None


def restarts_in_a_row(attempt: Attempt) -> int:
    """How many automatic restarts led up to this attempt since a person last created or restored it."""
    count = 0
    for earlier in attempt.run.attempts.filter(number__lte=attempt.number).order_by("-number"):
        if earlier.trigger != Attempt.RESTART:
            break
        count += 1
    return count


def mark_running(attempt_id: int, nodes: list[str]) -> bool:
    """The backend runs the attempt on `nodes`: a starting attempt moves to running (once); its nodes are kept
    and a pending reason cleared. False when it had ended meanwhile. The nodes only grow: a job that lost a
    node is still listed on it (Slurm drops a failed node from a job's list), so its failure can be placed."""
    with transaction.atomic():
        attempt = locked_attempt(attempt_id)
        if attempt.state in states.TERMINAL:
            return False
        nodes = [*attempt.nodes, *(node for node in nodes if node not in attempt.nodes)]
        if attempt.state == states.STARTING:
            move_attempt(attempt, states.RUNNING)
            payload = {"attempt": attempt.number, "state": states.RUNNING, "nodes": nodes}
            record_platform_event(attempt.run, attempt, "state", payload)
        Attempt.objects.filter(pk=attempt.pk).update(nodes=nodes, pending_reason="")
    return True


def note_pending(attempt_id: int, reason: str) -> None:
    """The backend holds the attempt back for `reason` (Slurm's Resources, Priority): kept on the attempt and
    told to its pages as a state event that keeps the state."""
    with transaction.atomic():
        attempt = locked_attempt(attempt_id)
        if attempt.state in states.TERMINAL or attempt.pending_reason == reason:
            return
        Attempt.objects.filter(pk=attempt.pk).update(pending_reason=reason)
        payload = {"attempt": attempt.number, "state": attempt.state, "pending_reason": reason}
        record_platform_event(attempt.run, attempt, "state", payload)
