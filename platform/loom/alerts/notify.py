"""Telling people: each alert that opens, is acknowledged or resolves goes to every page its run's owner has
open (a toast), and each that opens or resolves to the owner's webhooks (webhooks.py), once the transaction
that changed it commits."""

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction
from django.urls import reverse

from .consumers import user_alerts_group
from .models import Alert
from .services import Changes
from .webhooks import queue_deliveries

log = logging.getLogger(__name__)

OPENED = "opened"
UPDATED = "updated"
ACKNOWLEDGED = "acknowledged"
RESOLVED = "resolved"


def alert_wire(alert: Alert) -> dict:
    """An alert as pages and webhooks receive it."""
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


def announce(changes: Changes) -> None:
    for alert in changes.opened:
        announce_one(alert, OPENED)
    for alert in changes.resolved:
        announce_one(alert, RESOLVED)


def announce_one(alert: Alert, change: str) -> None:
    """After the current transaction commits (at once outside one)."""
    wire = alert_wire(alert)
    owner = alert.run.owner_id
    if change in (OPENED, RESOLVED):
        queue_deliveries(alert, change, wire)
    transaction.on_commit(lambda: _to_pages(owner, change, wire))


def _to_pages(owner: int, change: str, wire: dict) -> None:
    message = {"type": "alert.changed", "change": change, "alert": wire}
    try:
        async_to_sync(get_channel_layer().group_send)(user_alerts_group(owner), message)
    except Exception:
        log.exception("could not tell %s's pages about alert %s", owner, wire["id"])
