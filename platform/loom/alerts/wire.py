"""An alert as pages and webhooks receive it."""

from django.urls import reverse

from .models import Alert


def alert_wire(alert: Alert) -> dict:
    return {
        "id": alert.pk,
        "run": alert.run_id,
        "run_name": alert.run.name,
        "run_url": reverse("run-detail", args=[alert.run_id]),
        "triage_url": reverse("run-triage", args=[alert.run_id]) + f"#alert-{alert.pk}",
        "attempt": alert.attempt.number if alert.attempt_id else None,
        "rule": alert.rule,
        "rank": alert.rank,
        "ranks": alert.ranks,
        "host": alert.host,
        "severity": alert.severity,
        "state": alert.state,
        "step": alert.step,
        "last_step": alert.last_step,
        "message": alert.message,
        "resolution": alert.resolution,
        "opened_at": alert.opened_at.isoformat(),
    }
