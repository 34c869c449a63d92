from datetime import datetime
from typing import Any, Literal

from django.http import Http404
from ninja import Router, Schema, Status

from loom.api.errors import Body
from loom.runs import services as run_services

from . import notify, services, webhooks
from .delivery_report import RECENT_DELIVERIES
from .models import Alert, Webhook

router = Router(tags=["alerts"])


class AlertOut(Schema):
    id: int
    run: int
    attempt: int | None
    rule: str
    rank: int | None
    ranks: list[int]
    host: str
    severity: str
    state: str
    step: int
    last_step: int
    message: str
    details: dict
    occurrences: int
    opened_at: datetime
    last_seen_at: datetime
    acknowledged_at: datetime | None
    resolved_at: datetime | None
    resolution: str

    @staticmethod
    def resolve_run(alert):
        return alert.run_id

    @staticmethod
    def resolve_attempt(alert):
        return alert.attempt.number if alert.attempt_id else None


class FieldErrors(Schema):
    errors: dict[str, str]


@router.get("/runs/{run_id}/alerts", response=list[AlertOut])
def run_alerts(request, run_id: int, state: Literal["live", "all"] = "all"):
    """The run's alerts, newest first; `state=live`: only those open or acknowledged."""
    alerts = Alert.objects.filter(run=run_services.run_for(request.user, run_id)).select_related("attempt")
    return list(alerts.filter(state__in=Alert.LIVE) if state == "live" else alerts)


def _alert_for(user, alert_id: int) -> Alert:
    """The user's alert, or 404, as runs are."""
    alert = Alert.objects.filter(pk=alert_id, run__owner=user).select_related("attempt").first()
    if alert is None:
        raise Http404("no such alert")
    return alert


@router.post("/alerts/{alert_id}/acknowledge", response={200: AlertOut, 400: FieldErrors})
def acknowledge(request, alert_id: int):
    """Someone is on it: the alert stays live (and resolves by itself when its condition clears)."""
    try:
        alert = services.acknowledge(_alert_for(request.user, alert_id), request.user)
    except services.AlertStateError as error:
        return Status(400, {"errors": {"state": str(error)}})
    notify.announce_one(alert, notify.ACKNOWLEDGED)
    return alert


@router.post("/alerts/{alert_id}/resolve", response={200: AlertOut, 400: FieldErrors})
def resolve(request, alert_id: int):
    """Done with it; the same condition seen again opens a new alert."""
    try:
        alert = services.resolve(_alert_for(request.user, alert_id), request.user)
    except services.AlertStateError as error:
        return Status(400, {"errors": {"state": str(error)}})
    notify.announce_one(alert, notify.RESOLVED)
    return alert


class WebhookIn(Body):
    url: Any = None
    # A run of the user's: only its alerts; null: every run's.
    run: Any = None


class DeliveryOut(Schema):
    id: int
    alert: int
    event: str
    state: str
    tries: int
    last_status: int | None
    last_error: str
    created_at: datetime
    finished_at: datetime | None

    @staticmethod
    def resolve_alert(delivery):
        return delivery.alert_id

    @staticmethod
    def resolve_event(delivery):
        return delivery.payload.get("event", "")


class WebhookOut(Schema):
    id: int
    url: str
    run: int | None
    created_at: datetime
    deliveries: list[DeliveryOut]

    @staticmethod
    def resolve_run(hook):
        return hook.run_id

    @staticmethod
    def resolve_deliveries(hook):
        return list(hook.deliveries.all()[:RECENT_DELIVERIES])


@router.get("/webhooks", response=list[WebhookOut])
def list_webhooks(request):
    """The user's webhooks, each with its latest deliveries (failed ones say why)."""
    return list(Webhook.objects.filter(owner=request.user))


@router.post("/webhooks", response={201: WebhookOut, 400: FieldErrors})
def create_webhook(request, body: WebhookIn):
    """POST every alert that opens or resolves, as {"event": "alert.opened", "alert": {...}}, to `url`."""
    try:
        hook = webhooks.create_webhook(request.user, body.url, body.run)
    except webhooks.WebhookInputError as error:
        return Status(400, {"errors": error.errors})
    return Status(201, hook)


@router.delete("/webhooks/{webhook_id}", response={204: None})
def delete_webhook(request, webhook_id: int):
    deleted, _ = Webhook.objects.filter(pk=webhook_id, owner=request.user).delete()
    if not deleted:
        raise Http404("no such webhook")
    return Status(204, None)
