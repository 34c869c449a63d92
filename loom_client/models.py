"""What the platform's API answers, as typed objects. Fields the platform adds later are ignored, so an older
client keeps working against a newer platform; the names follow the API's own (platform/loom/*/api.py)."""

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict

TERMINAL_STATES = ("succeeded", "failed", "cancelled")


class Answer(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class Run(Answer):
    id: int
    name: str
    state: str
    created_at: datetime
    updated_at: datetime
    last_seq: int
    tags: list[str]
    note: str
    archived: bool

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES


class ListedRun(Run):
    """A run as the run list gives it, with the columns a user scans."""

    # The latest attempt's parallel degrees (dp_replicate, dp_shard, tp, pp, cp, ep).
    layout: dict[str, int]
    world_size: int
    # The latest attempt's highest step reported (null before its first), of the steps its config runs to.
    steps_done: int | None
    steps_total: int
    last_loss: float | None
    tokens_per_s: float | None
    duration_s: float | None
    # Alerts open or acknowledged, and of those the critical ones.
    open_alerts: int
    critical_alerts: int


class RunPage(Answer):
    runs: list[ListedRun]
    next_cursor: str | None


class Attempt(Answer):
    number: int
    state: str
    exit_code: int | None
    failure_reason: str
    failure_kind: str
    retryable: bool | None
    restart_decision: str
    backend: str
    nodes: list[str]
    pending_reason: str
    trigger: str
    trigger_note: str
    restored_from: int | None
    restored_from_step: int | None
    world_size: int
    parallel: dict[str, Any]
    batches_set_aside: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES


class RunDetail(Run):
    config: dict[str, Any]
    estimate: dict[str, Any] | None
    attempts: list[Attempt]
    forked_from: int | None
    forked_from_run: int | None
    forked_from_step: int | None

    @property
    def latest_attempt(self) -> Attempt | None:
        return max(self.attempts, key=lambda attempt: attempt.number, default=None)


class CreatedRun(RunDetail):
    # What the run will do on the launcher's hardware other than planned, by field; it was created all the same.
    warnings: dict[str, str]


class Event(Answer):
    seq: int
    kind: str
    attempt: int | None
    rank: int | None
    step: int | None
    time: float
    payload: dict[str, Any]


class EventPage(Answer):
    events: list[Event]
    last_seq: int
    more: bool


class LogTail(Answer):
    rank: int
    attempt: int
    # File name (stdout.log, stderr.log) to its last lines.
    files: dict[str, list[str]]


class Checkpoint(Answer):
    id: int
    run: int
    attempt: int
    step: int
    state: str
    path: str
    bytes: int
    layout: dict[str, Any]
    world_size: int
    parent: int | None
    loss: float | None
    stall_s: float | None
    save_s: float | None
    problem: str
    committed_at: datetime
    pinned: bool
    pins: list[str]
    user_pinned: bool


class Restored(Answer):
    run: int
    attempt: int
    # True when the checkpoint became the first attempt of a new run rather than this run's next attempt.
    forked: bool


class Alert(Answer):
    id: int
    rule: str
    rank: int | None
    severity: str
    state: str
    step: int
    last_step: int
    message: str
