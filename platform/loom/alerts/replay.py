"""What a page may have missed: the alerts of a user's runs opened since a moment, for a page whose
websocket message was dropped (channels_redis drops group messages when a channel is full) or that was
reconnecting when one was sent. Pages ask on every connect and every LOOM_ALERTS_RESYNC_S, and drop the
ones they have shown already."""

from datetime import datetime

from .models import Alert
from .wire import alert_wire

# A page that was away longer than this has the run list to tell it; toasts are for what is new.
REPLAY_LIMIT = 50


def opened_since(user_id: int, since: datetime) -> list[dict]:
    """The user's live alerts opened at or after `since`, oldest first."""
    alerts = (
        Alert.objects.filter(run__owner_id=user_id, opened_at__gte=since, state__in=Alert.LIVE)
        .select_related("run", "attempt")
        .order_by("-opened_at", "-id")[:REPLAY_LIMIT]
    )
    return [alert_wire(alert) for alert in reversed(alerts)]
