"""What the triage page shows of a run: one timeline of attempts, alerts and checkpoints; the suspects (ranks
and nodes by how many alerts implicate them); for each alert, the checkpoint to restore from and the log
lines its ranks wrote around its step; and a search across every rank log of the run."""

import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from loom.checkpoints.models import COMMITTED, Checkpoint
from loom.checkpoints.services import restore_point_for
from loom.runs.logs import rank_log_files, tail_lines
from loom.runs.models import Run
from trainer.config import world_size_of

from .detectors import GRAD_NORM_SPIKE, LOSS_SPIKE, NON_FINITE
from .models import Alert

# Ranks of an alert whose logs are shown beside it; lines before and after its step's line.
LOG_RANKS = 4
LOG_CONTEXT_LINES = 6
LOG_SCAN_LINES = 5000
SEARCH_LIMIT = 200


@dataclass(frozen=True)
class TimelineEntry:
    at: datetime
    kind: str
    text: str
    anchor: str = ""


@dataclass
class Suspect:
    name: str
    alerts: int = 0
    rules: Counter = field(default_factory=Counter)

    @property
    def rule_counts(self) -> list[tuple[str, int]]:
        """For templates, which would read `rules.items` as the count of a rule named "items"."""
        return self.rules.most_common()


@dataclass(frozen=True)
class LogExcerpt:
    attempt: int
    rank: int
    file: str
    lines: list[str]


# Alerts about the data a step trained on: restoring past them may skip that data and lower the learning
# rate, as OPT-175B's operators did by hand.
DATA_RULES = frozenset({LOSS_SPIKE, GRAD_NORM_SPIKE, NON_FINITE})
LOWER_LR_FACTOR = 0.5


@dataclass
class AlertView:
    alert: Alert
    restore_from: Checkpoint | None
    logs: list[LogExcerpt]
    # For DATA_RULES with a checkpoint before: the steps to skip, and the peak learning rate then and offered.
    skip_steps: tuple[int, int] | None = None
    lr: float | None = None
    lower_lr: float | None = None


def timeline(run: Run, alerts: list[Alert]) -> list[TimelineEntry]:
    entries = []
    for attempt in run.attempts.all():
        trigger = attempt.trigger_note or attempt.trigger
        entries.append(TimelineEntry(attempt.created_at, "attempt", f"attempt {attempt.number} created ({trigger})"))
        if attempt.started_at:
            entries.append(TimelineEntry(attempt.started_at, "attempt", f"attempt {attempt.number} started"))
        if attempt.finished_at:
            how = attempt.state + (f": {attempt.failure_kind.replace('_', ' ')}" if attempt.failure_kind else "")
            entries.append(
                TimelineEntry(attempt.finished_at, f"end {attempt.state}", f"attempt {attempt.number} {how}")
            )
    for alert in alerts:
        anchor = f"alert-{alert.pk}"
        entries.append(TimelineEntry(alert.opened_at, f"alert {alert.severity}", alert.message, anchor))
        if alert.resolved_at:
            entries.append(TimelineEntry(alert.resolved_at, "resolved", f"{alert.rule}: {alert.resolution}", anchor))
    for checkpoint in Checkpoint.objects.filter(run=run, state=COMMITTED).select_related("attempt"):
        text = f"checkpoint at step {checkpoint.step} (attempt {checkpoint.attempt.number})"
        entries.append(TimelineEntry(checkpoint.committed_at, "checkpoint", text))
    return sorted(entries, key=lambda entry: entry.at)


def suspects(alerts: list[Alert]) -> tuple[list[Suspect], list[Suspect]]:
    """Ranks and nodes, most implicated first. A rank is implicated by an alert about it, or by a run-level
    alert that names a few ranks (not one that names them all)."""
    ranks: dict[int, Suspect] = {}
    nodes: dict[str, Suspect] = {}
    for alert in alerts:
        named = [alert.rank] if alert.rank is not None else _few(alert)
        for rank in named:
            suspect = ranks.setdefault(rank, Suspect(f"rank {rank}"))
            suspect.alerts += 1
            suspect.rules[alert.rule] += 1
        if alert.host:
            node = nodes.setdefault(alert.host, Suspect(alert.host))
            node.alerts += 1
            node.rules[alert.rule] += 1
    order = lambda suspect: (-suspect.alerts, suspect.name)  # noqa: E731
    return sorted(ranks.values(), key=order), sorted(nodes.values(), key=order)


def _few(alert: Alert) -> list[int]:
    world = world_size_of(alert.attempt.config) if alert.attempt_id else len(alert.ranks)
    return alert.ranks if len(alert.ranks) < max(2, world) else []


def alert_views(run: Run, alerts: list[Alert]) -> list[AlertView]:
    checkpoints = list(Checkpoint.objects.filter(run=run, state=COMMITTED).order_by("step", "id"))
    views = []
    for alert in alerts:
        # The same checkpoint the alert pins against retention while it is live.
        view = AlertView(alert, restore_point_for(alert, checkpoints), _logs_around(alert))
        if view.restore_from is not None and alert.rule in DATA_RULES and alert.attempt is not None:
            view.skip_steps = (view.restore_from.step + 1, alert.last_step)
            view.lr = alert.attempt.config["optimizer"]["lr"]
            view.lower_lr = view.lr * LOWER_LR_FACTOR
        views.append(view)
    return views


def _logs_around(alert: Alert) -> list[LogExcerpt]:
    """The lines each implicated rank (the first few) wrote around the alert's step."""
    if alert.attempt is None or not alert.attempt.work_dir:
        return []
    ranks = ([alert.rank] if alert.rank is not None else alert.ranks)[:LOG_RANKS]
    pattern = re.compile(rf"\bstep {alert.step}\b")
    excerpts = []
    for rank in ranks:
        for path in rank_log_files(alert.attempt.work_dir, rank):
            lines = tail_lines(path, LOG_SCAN_LINES)
            hits = [index for index, line in enumerate(lines) if pattern.search(line)]
            centre = hits[0] if hits else len(lines) - 1
            window = lines[max(0, centre - LOG_CONTEXT_LINES) : centre + LOG_CONTEXT_LINES + 1]
            if window:
                excerpts.append(LogExcerpt(alert.attempt.number, rank, path.name, window))
    return excerpts


@dataclass(frozen=True)
class SearchHit:
    attempt: int
    rank: int
    file: str
    line: str


def search_logs(run: Run, query: str) -> list[SearchHit]:
    """Lines containing `query` (case-insensitive) in every rank log of every attempt, first SEARCH_LIMIT."""
    needle = query.lower()
    hits = []
    for attempt in run.attempts.exclude(work_dir="").order_by("number"):
        for rank in range(world_size_of(attempt.config)):
            for path in rank_log_files(Path(attempt.work_dir), rank):
                for line in tail_lines(path, LOG_SCAN_LINES):
                    if needle in line.lower():
                        hits.append(SearchHit(attempt.number, rank, path.name, line))
                        if len(hits) >= SEARCH_LIMIT:
                            return hits
    return hits
