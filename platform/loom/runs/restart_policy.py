"""The automatic restart policy, as a pure function of what is known about a failed attempt: after a
retryable failure, the run's next attempt resumes from the newest good checkpoint the failed attempt wrote,
up to restart.max_restarts times in a row."""

from dataclasses import dataclass
from pathlib import PurePath

DEFAULT_MAX_RESTARTS = 3


@dataclass(frozen=True)
class CheckpointRef:
    id: int
    step: int
    path: str


@dataclass(frozen=True)
class FailedAttempt:
    number: int
    retryable: bool | None
    failure_kind: str
    failure_reason: str
    max_restarts: int
    restarts_in_a_row: int  # automatic restarts that led up to it since a person created or restored it
    later_attempt_exists: bool
    newest_committed: CheckpointRef | None  # of its own checkpoints
    restored_from: CheckpointRef | None  # where it started
    configured_resume: str | None  # its config's checkpoint.resume


@dataclass(frozen=True)
class Restart:
    resume: str | None  # a checkpoint or a directory of them; None: from the start
    source: CheckpointRef | None
    note: str  # on the new attempt: why it exists
    origin: str  # "from its checkpoints (newest: step 30)"


@dataclass(frozen=True)
class Decision:
    restart: Restart | None
    summary: str  # on the failed attempt, in words; completed with the new attempt's number once it exists


def decide(failed: FailedAttempt) -> Decision:
    if failed.later_attempt_exists:
        return Decision(None, "not restarted: a later attempt exists")
    if not failed.retryable:
        kind = (failed.failure_kind or "unclassified").replace("_", " ")
        return Decision(None, f"not restarted: a failure of kind '{kind}' would happen again")
    used, limit = failed.restarts_in_a_row, failed.max_restarts
    if used >= limit:
        return Decision(None, f"not restarted: {used} of {limit} automatic restarts used (restart.max_restarts)")
    if failed.newest_committed is not None:
        source = failed.newest_committed
        # The directory, not the one checkpoint: the trainer verifies the newest and falls back past a corrupt
        # one to the one before.
        resume = str(PurePath(source.path).parent)
        origin = f"from its checkpoints (newest: step {source.step})"
    elif failed.restored_from is not None:
        source, resume = failed.restored_from, failed.restored_from.path
        origin = f"from step {source.step}, where it had started"
    else:
        source, resume = None, failed.configured_resume
        origin = "from the start: it had committed no checkpoint"
    cause = failed.failure_reason.splitlines() or ["unknown cause"]
    cause_line = next((line for line in cause if not line.startswith("torchrun exited")), cause[0])
    note = f"automatic restart {used + 1} of {limit} after attempt {failed.number} failed ({cause_line}), {origin}"
    return Decision(Restart(resume, source, note, origin), "restarted as attempt {number} " + origin)
