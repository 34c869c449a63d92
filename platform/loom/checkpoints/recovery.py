"""The automatic restart policy: after a retryable failure, the run's next attempt resumes from the
newest good checkpoint its failed attempt wrote, up to restart.max_restarts times in a row."""

from pathlib import Path

from loom.runs import services as run_services
from loom.runs.models import Attempt

from . import services

DEFAULT_MAX_RESTARTS = 3


def restart_after_failure(attempt: Attempt) -> Attempt | None:
    """Decide, record the decision on the failed attempt, and start the restart if there is one.
    Called inside the transaction that marked the attempt failed, holding its run's row lock."""
    decision, restart = _decide(attempt)
    Attempt.objects.filter(pk=attempt.pk).update(restart_decision=decision)
    attempt.restart_decision = decision
    return restart


def _decide(attempt: Attempt) -> tuple[str, Attempt | None]:
    if attempt.run.attempts.filter(number__gt=attempt.number).exists():
        return "not restarted: a later attempt exists", None
    if not attempt.retryable:
        kind = (attempt.failure_kind or "unclassified").replace("_", " ")
        return f"not restarted: a failure of kind '{kind}' would happen again", None
    limit = attempt.config.get("restart", {}).get("max_restarts", DEFAULT_MAX_RESTARTS)
    used = restarts_in_a_row(attempt)
    if used >= limit:
        return f"not restarted: {used} of {limit} automatic restarts used (restart.max_restarts)", None
    source = services.latest_committed(attempt)
    if source is not None:
        # The directory, not the one checkpoint: the trainer verifies the newest and falls back past
        # a corrupt one to the one before.
        resume = str(Path(source.path).parent)
        origin = f"from its checkpoints (newest: step {source.step})"
    elif attempt.restored_from is not None:
        source, resume = attempt.restored_from, attempt.restored_from.path
        origin = f"from step {source.step}, where it had started"
    else:
        resume = attempt.config.get("checkpoint", {}).get("resume")
        origin = "from the start: it had committed no checkpoint"
    cause = attempt.failure_reason.splitlines() or ["unknown cause"]
    cause_line = next((line for line in cause if not line.startswith("torchrun exited")), cause[0])
    note = f"automatic restart {used + 1} of {limit} after attempt {attempt.number} failed ({cause_line}), {origin}"
    config = services.resumed_config(attempt.config, resume)
    restart = run_services.queue_attempt(attempt.run, config, Attempt.RESTART, note, source)
    return f"restarted as attempt {restart.number} {origin}", restart


def restarts_in_a_row(attempt: Attempt) -> int:
    """How many automatic restarts led up to this attempt since a person last created or restored it."""
    count = 0
    for earlier in attempt.run.attempts.filter(number__lte=attempt.number).order_by("-number"):
        if earlier.trigger != Attempt.RESTART:
            break
        count += 1
    return count
