"""Hangs: what stops arriving. A rank whose heartbeats stop is dead or frozen; a run whose steps stop while
its ranks still beat is stuck (a collective one rank never joins, a deadlock, a stalled file system). Every
rank then waits at the same step, and the ranks' collective progress (culprits.py) names the one they
wait for; without it (telemetry.comm off) the whole run is named.

Judged by the platform's clock alone (when heartbeats and metrics were stored), so a rank whose clock is off
is judged like any other.
"""

from datetime import datetime

from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from loom.runs import states
from loom.runs.models import Attempt
from loom.telemetry.models import Event, RankStatus, RankStep
from trainer.config import AlertsConfig, world_size_of

from .culprits import find_culprits
from .detectors import CRITICAL, HANG, Finding
from .evaluate import alerts_config
from .services import Changes, alert_key, host_lookup, record, resolve_cleared

# A hang's collective counts are read once nothing has moved on a rank for half of hang_after_s, or this long.
SETTLE_MAX_S = 30.0


def check_hangs(now: datetime | None = None) -> list[Changes]:
    """Open (or keep) a hang alert for every running attempt that is hung now, resolve those that are not."""
    now = now or timezone.now()
    results = []
    for attempt in Attempt.objects.filter(state=states.RUNNING):
        config = alerts_config(attempt)
        if not config.enabled:
            continue
        findings = hang_findings(attempt, config, now)
        with transaction.atomic():
            changes = record(attempt, findings, host_lookup(attempt))
            resolved = resolve_cleared(attempt, HANG, {alert_key(finding.rule, finding.rank) for finding in findings})
        results.append(Changes(changes.opened, changes.updated, resolved))
    return results


def hang_findings(attempt: Attempt, config: AlertsConfig, now: datetime) -> list[Finding]:
    started = attempt.started_at or now
    statuses = {status.rank: status for status in attempt.rank_status.all()}
    latest, last_progress = _progress(attempt, statuses.values())
    if latest is not None and latest >= attempt.config.get("steps", latest + 1):
        # Every step is done: the ranks are saving, flushing and exiting, and the attempt ends when its backend
        # says so. A wait there (a loaded host, a last checkpoint) is no hang.
        return []
    findings = []
    # Ranks silent for hang_after_s, or never heard from within the grace.
    patience = config.hang_after_s if latest is not None else config.hang_grace_s
    for rank in range(world_size_of(attempt.config)):
        status = statuses.get(rank)
        heard_at = status.heard_at if status else None
        silent_s = (now - (heard_at or started)).total_seconds()
        if silent_s > patience:
            # A rank whose heartbeats are late but whose metrics arrive is alive (a starved heartbeat thread).
            heard_at = max(filter(None, (heard_at, _metrics_heard_at(attempt, rank))), default=None)
            silent_s = (now - (heard_at or started)).total_seconds()
        if silent_s > patience:
            since = f"for {silent_s:.0f} s" if heard_at else "since the attempt started"
            step = status.last_step if status else None
            message = f"no heartbeat from rank {rank} {since} (its last step: {step})"
            details = {"silent_s": round(silent_s, 1), "heard_at": heard_at.isoformat() if heard_at else None}
            findings.append(Finding(HANG, latest or 0, CRITICAL, message, rank=rank, ranks=(rank,), details=details))
    # No step completed for hang_after_s (hang_grace_s before the first).
    stalled_s = (now - (last_progress or started)).total_seconds()
    if stalled_s > patience:
        findings.append(_stalled(statuses, latest, stalled_s, settle_s=min(config.hang_after_s / 2, SETTLE_MAX_S)))
    return findings


def _stalled(statuses: dict[int, RankStatus], latest: int | None, stalled_s: float, settle_s: float) -> Finding:
    progress = {rank: status.collectives for rank, status in statuses.items() if status.collectives}
    verdict = find_culprits(progress, settle_s)
    after = f"since step {latest}" if latest is not None else "since the attempt started, no step at all"
    message = f"no step completed for {stalled_s:.0f} s ({after})"
    if verdict.culprits:
        message += f"; {verdict.describe({rank: status.host for rank, status in statuses.items()})}"
    elif not progress:
        message += "; the ranks' collective progress is not recorded (telemetry.comm), so none can be named"
    details = {
        "stalled_s": round(stalled_s, 1),
        "last_step": latest,
        "culprits": [
            {"rank": suspect.rank, "evidence": list(suspect.evidence), "waiting": suspect.waiting}
            for suspect in verdict.culprits
        ],
        "waiting": {str(rank): text for rank, text in sorted(verdict.waits.items())},
    }
    ranks = tuple(suspect.rank for suspect in verdict.culprits)
    return Finding(HANG, latest or 0, CRITICAL, message, ranks=ranks, details=details)


def _metrics_heard_at(attempt: Attempt, rank: int) -> datetime | None:
    """When the platform stored the rank's newest step's metrics."""
    step = RankStep.objects.filter(attempt=attempt, rank=rank).order_by("-step").values_list("step", flat=True).first()
    return None if step is None else _metrics_stored_at(attempt, step, rank)


def _metrics_stored_at(attempt: Attempt, step: int, rank: int | None = None) -> datetime | None:
    """When the platform stored the last of the step's metric events (of every rank, or of `rank`)."""
    metrics = Event.objects.filter(attempt=attempt, kind="metric", step=step)
    if rank is not None:
        metrics = metrics.filter(rank=rank)
    return metrics.aggregate(at=Max("received_at"))["at"]


def _progress(attempt: Attempt, statuses) -> tuple[int | None, datetime | None]:
    """The newest step the platform knows of and when it first heard of it: from the step's stored metrics,
    or from a heartbeat that names a step whose metrics are not stored yet."""
    stored = RankStep.objects.filter(attempt=attempt).aggregate(step=Max("step"))["step"]
    beats = [status for status in statuses if status.last_step is not None]
    beaten = max((status.last_step for status in beats), default=None)
    if beaten is not None and (stored is None or beaten > stored):
        return beaten, min(status.heard_at for status in beats if status.last_step == beaten)
    if stored is None:
        return None, None
    return stored, _metrics_stored_at(attempt, stored)
