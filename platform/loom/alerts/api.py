from datetime import datetime
from typing import Literal

from django.http import Http404
from ninja import Router, Schema, Status

from loom.runs import services as run_services

from . import services
from .models import Alert

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
        return services.acknowledge(_alert_for(request.user, alert_id), request.user)
    except services.AlertStateError as error:
        return Status(400, {"errors": {"state": str(error)}})


@router.post("/alerts/{alert_id}/resolve", response={200: AlertOut, 400: FieldErrors})
def resolve(request, alert_id: int):
    """Done with it; the same condition seen again opens a new alert."""
    try:
        return services.resolve(_alert_for(request.user, alert_id), request.user)
    except services.AlertStateError as error:
        return Status(400, {"errors": {"state": str(error)}})
