"""An alert's life: opened by a finding, updated while its condition is seen again, acknowledged or
resolved by a user; a live condition (LIVE_CONDITIONS) also resolves by itself once it has not been seen for
clear_after_steps steps, or once the attempt it was seen in ends, and a routing condition (ROUTING_CONDITIONS)
once it has not been seen for clear_after_steps steps."""

import functools
from collections.abc import Callable
from dataclasses import dataclass

from django.db import IntegrityError, transaction
from django.db.models import Max
from django.utils import timezone

from loom.runs import states
from loom.runs.models import Attempt
from loom.telemetry.models import RankStatus, RankStep

from .detectors import (
    CRITICAL,
    EXPERT_COLLAPSE,
    EXPERT_IMBALANCE,
    HANG,
    MEMORY_CREEP,
    RANK_EXIT,
    STRAGGLER,
    THROUGHPUT_DROP,
    Finding,
)
from .models import Alert

# What is wrong only while ranks run: a slow or silent rank, falling throughput, growing memory. Once the
# attempt ends there is nothing left to watch or to act on, so these resolve with it. The other rules (a rank
# that exited, a non-finite loss, a loss or gradient-norm spike) are about what the run did to its model: a
# person must decide whether to restore past them, so they stay open after the attempt ends.
LIVE_CONDITIONS = frozenset({STRAGGLER, THROUGHPUT_DROP, MEMORY_CREEP, HANG})
# A collapsed expert or an imbalanced layer is in the router's weights, not in the running ranks: the checkpoint
# keeps it and a restart resumes it, so it stays live when its attempt ends. But training can heal it (the
# balance loss, the routing bias), so once it has not been seen for clear_after_steps steps it is over.
ROUTING_CONDITIONS = frozenset({EXPERT_COLLAPSE, EXPERT_IMBALANCE})


class AlertStateError(ValueError):
    """The change asked for does not apply to the alert as it stands."""


@dataclass(frozen=True)
class Changes:
    opened: list[Alert]
    updated: list[Alert]
    resolved: list[Alert]

    def __bool__(self) -> bool:
        return bool(self.opened or self.updated or self.resolved)


def alert_key(rule: str, rank: int | None) -> str:
    return f"{rule}:{'run' if rank is None else rank}"


def record(attempt: Attempt, findings: list[Finding], host: Callable[[int], str]) -> Changes:
    """Open an alert for each finding with no live alert of its rule and rank in the run; update the live one
    otherwise. Two processes finding the same thing at once end with one alert. A live condition judged
    after its attempt ended (the watcher's last pass over its last metrics) is not news: it is over."""
    opened, updated = [], []
    if any(finding.rule in LIVE_CONDITIONS for finding in findings) and _has_ended(attempt):
        findings = [finding for finding in findings if finding.rule not in LIVE_CONDITIONS]
    for finding in findings:
        alert, created = _open_or_update(attempt, finding, host)
        if alert is not None:
            (opened if created else updated).append(alert)
    return Changes(opened, updated, [])


def _has_ended(attempt: Attempt) -> bool:
    return Attempt.objects.filter(pk=attempt.pk, state__in=states.TERMINAL).exists()


def _open_or_update(attempt: Attempt, finding: Finding, host: Callable[[int], str]) -> tuple[Alert | None, bool]:
    key = alert_key(finding.rule, finding.rank)
    now = timezone.now()
    for _ in range(2):
        live = Alert.objects.filter(run_id=attempt.run_id, key=key, state__in=Alert.LIVE).first()
        if live is not None:
            # Seen already, unless it names more ranks (a hang's culprit, once the ranks' progress settles);
            # a restarted attempt may report the same steps again, and that is news.
            news = finding.step > live.last_step or not set(finding.ranks) <= set(live.ranks)
            if not news and live.attempt_id == attempt.pk:
                return None, False
            live.attempt = attempt
            live.last_step = finding.step
            live.occurrences += 1
            live.last_seen_at = now
            live.message = finding.message
            live.details = finding.details
            live.ranks = sorted(set(live.ranks) | set(finding.ranks))
            live.save(
                update_fields=["attempt", "last_step", "occurrences", "last_seen_at", "message", "details", "ranks"]
            )
            return live, False
        try:
            with transaction.atomic():
                alert = Alert.objects.create(
                    run_id=attempt.run_id,
                    attempt=attempt,
                    rule=finding.rule,
                    rank=finding.rank,
                    key=key,
                    severity=finding.severity,
                    step=finding.step,
                    last_step=finding.step,
                    ranks=list(finding.ranks),
                    host=host(finding.rank) if finding.rank is not None else "",
                    message=finding.message,
                    details=finding.details,
                )
            return alert, True
        except IntegrityError:
            # Another process opened it between the look and the insert: update that one.
            continue
    return None, False


def record_exit(attempt: Attempt, rank: int | None, cause: str) -> Changes:
    """The attempt failed: an alert naming the rank that failed first and why (`cause`), as the launcher
    classified it (failures.py), with whether the restart policy may try again, at the last step the
    ranks completed."""
    latest = last_completed_step(attempt, rank)
    retry = "retryable" if attempt.retryable else "not retryable"
    kind = attempt.failure_kind.replace("_", " ")
    finding = Finding(
        RANK_EXIT,
        latest,
        CRITICAL,
        f"attempt {attempt.number} failed ({kind}, {retry}): {cause or attempt.failure_reason[:200]}",
        rank=rank,
        ranks=(rank,) if rank is not None else (),
        details={"kind": attempt.failure_kind, "retryable": attempt.retryable, "reason": attempt.failure_reason},
    )
    return record(attempt, [finding], host_lookup(attempt))


def last_completed_step(attempt: Attempt, rank: int | None) -> int:
    """The last step `rank` completed by its stored metrics (any rank's when it is None or stored none).
    Not the heartbeats': they come seconds apart and carry whatever step their rank had emitted then, far
    behind the metrics of fast steps. Without any metric, the heartbeats' step, else the step resumed from."""
    steps = RankStep.objects.filter(attempt=attempt)
    latest = steps.filter(rank=rank).aggregate(latest=Max("step"))["latest"] if rank is not None else None
    if latest is None:
        latest = steps.aggregate(latest=Max("step"))["latest"]
    if latest is None:
        latest = RankStatus.objects.filter(attempt=attempt).aggregate(latest=Max("last_step"))["latest"]
    if latest is None and attempt.restored_from_id is not None:
        latest = attempt.restored_from.step
    return latest or 0


def end_live_conditions(attempt: Attempt) -> Changes:
    """The attempt ended: resolve its alerts of LIVE_CONDITIONS, saying so."""
    with transaction.atomic():
        live = Alert.objects.filter(attempt=attempt, rule__in=LIVE_CONDITIONS, state__in=Alert.LIVE)
        ended = list(live.select_for_update())
        for alert in ended:
            _mark_resolved(alert, f"attempt {attempt.number} ended ({attempt.state})")
    return Changes([], [], ended)


def host_lookup(attempt: Attempt) -> Callable[[int], str]:
    """A rank's host, read when first asked for: a pass that names no rank reads none of 1,024."""

    @functools.cache
    def host(rank: int) -> str:
        return RankStatus.objects.filter(attempt=attempt, rank=rank).values_list("host", flat=True).first() or ""

    return host


def clear_stale(attempt: Attempt, latest_step: int, clear_after_steps: int) -> list[Alert]:
    """Resolve the run's live alerts of LIVE_CONDITIONS and ROUTING_CONDITIONS whose condition was last seen
    clear_after_steps or more steps before the attempt's latest step. A spike, a non-finite loss or an exit is
    never seen again by nature, and is no less for it: those wait for a person (and keep their checkpoint pinned
    meanwhile)."""
    stale = list(
        Alert.objects.filter(
            run_id=attempt.run_id,
            rule__in=LIVE_CONDITIONS | ROUTING_CONDITIONS,
            state__in=Alert.LIVE,
            last_step__lte=latest_step - clear_after_steps,
        ).select_for_update()
    )
    for alert in stale:
        _mark_resolved(alert, f"cleared: not seen since step {alert.last_step} (through step {latest_step})")
    return stale


def resolve_cleared(attempt: Attempt, rule: str, live_keys: set[str]) -> list[Alert]:
    """Resolve the attempt's live alerts of `rule` whose condition is not present now (not in live_keys)."""
    cleared = [
        alert
        for alert in Alert.objects.filter(attempt=attempt, rule=rule, state__in=Alert.LIVE).select_for_update()
        if alert.key not in live_keys
    ]
    for alert in cleared:
        _mark_resolved(alert, "cleared: its condition is gone")
    return cleared


def acknowledge(alert: Alert, user) -> Alert:
    if alert.state != Alert.OPEN:
        raise AlertStateError(f"only an open alert can be acknowledged; this one is {alert.state}")
    alert.state = Alert.ACKNOWLEDGED
    alert.acknowledged_at = timezone.now()
    alert.acknowledged_by = user
    alert.save(update_fields=["state", "acknowledged_at", "acknowledged_by"])
    return alert


def resolve(alert: Alert, user) -> Alert:
    if alert.state == Alert.RESOLVED:
        raise AlertStateError("this alert is resolved already")
    _mark_resolved(alert, f"resolved by {user.get_username()}")
    return alert


def _mark_resolved(alert: Alert, resolution: str) -> None:
    alert.state = Alert.RESOLVED
    alert.resolved_at = timezone.now()
    alert.resolution = resolution
    alert.save(update_fields=["state", "resolved_at", "resolution"])
