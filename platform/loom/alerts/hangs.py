"""Hangs: what stops arriving. A rank whose heartbeats stop is dead or frozen; a run whose steps stop while
its ranks still beat is stuck (a collective one rank never joins, a deadlock, a stalled file system): every
rank then waits at the same step, so the whole run is named, with the step it stopped after.

Judged from the platform's clock against the ranks' own timestamps; the ranks and the platform are
expected to keep their clocks in sync (NTP), as the heartbeat times on the run page assume.
"""

from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from loom.runs import states
from loom.runs.models import Attempt
from loom.telemetry.models import RankStep
from trainer.config import AlertsConfig, world_size_of

from .detectors import CRITICAL, HANG, Finding
from .evaluate import alerts_config
from .services import Changes, alert_key, host_lookup, record, resolve_cleared


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
    statuses = {
        rank: (beat, step)
        for rank, beat, step in attempt.rank_status.values_list("rank", "last_heartbeat", "last_step")
    }
    latest = max((step for _, step in statuses.values() if step is not None), default=None)
    findings = []
    # Ranks silent for hang_after_s, or never heard from within the grace.
    patience = timedelta(seconds=config.hang_after_s if latest is not None else config.hang_grace_s)
    for rank in range(world_size_of(attempt.config)):
        beat, step = statuses.get(rank, (None, None))
        silent_s = (now - (beat or started)).total_seconds()
        if silent_s > patience.total_seconds():
            since = f"for {silent_s:.0f} s" if beat else "since the attempt started"
            message = f"no heartbeat from rank {rank} {since} (its last step: {step})"
            details = {"silent_s": round(silent_s, 1), "last_heartbeat": beat.isoformat() if beat else None}
            findings.append(Finding(HANG, latest or 0, CRITICAL, message, rank=rank, ranks=(rank,), details=details))
    # No step completed for hang_after_s (hang_grace_s before the first).
    last_progress = _last_step_time(attempt, latest) if latest is not None else started
    limit = config.hang_after_s if latest is not None else config.hang_grace_s
    stalled_s = (now - last_progress).total_seconds()
    if stalled_s > limit:
        after = f"since step {latest}" if latest is not None else "since the attempt started, no step at all"
        message = f"no step completed for {stalled_s:.0f} s ({after}); the ranks still beating wait with it"
        details = {"stalled_s": round(stalled_s, 1), "last_step": latest}
        beating = tuple(sorted(rank for rank, (beat, _) in statuses.items() if beat and now - beat <= patience))
        findings.append(Finding(HANG, latest or 0, CRITICAL, message, ranks=beating, details=details))
    return findings


def _last_step_time(attempt: Attempt, step: int) -> datetime:
    # A heartbeat can name a step whose metrics are not stored yet: that step is progress just made.
    return RankStep.objects.filter(attempt=attempt, step=step).aggregate(at=Max("time"))["at"] or timezone.now()
