"""Telling people: each alert that opens, is acknowledged or resolves goes to every page its run's owner has
open (a toast), and each that opens or resolves to the owner's webhooks (webhooks.py), once the transaction
that changed it commits."""

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

from .consumers import user_alerts_group
from .models import Alert
from .services import Changes
from .webhooks import queue_deliveries
from .wire import alert_wire

log = logging.getLogger(__name__)

OPENED = "opened"
UPDATED = "updated"
ACKNOWLEDGED = "acknowledged"
RESOLVED = "resolved"


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
