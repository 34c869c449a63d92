"""Webhooks: an alert's change POSTed as JSON to each of its owner's webhooks (all runs, or that run), by a
Celery task that retries with growing waits; every try's outcome is kept on the delivery."""

import json
import urllib.error
import urllib.request

from celery import shared_task
from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import URLValidator
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from loom.runs.models import Run

from .models import Alert, Webhook, WebhookDelivery

TIMEOUT_S = 10.0


class WebhookInputError(ValueError):
    def __init__(self, errors: dict[str, str]):
        self.errors = errors
        super().__init__("; ".join(f"{field}: {message}" for field, message in errors.items()))


def create_webhook(owner, url, run_id) -> Webhook:
    """A webhook for all the owner's runs (run_id None) or one of them; field-level errors, nothing saved."""
    errors = {}
    if not isinstance(url, str) or not url.strip():
        errors["url"] = "required: the http(s) address alerts are POSTed to"
    else:
        try:
            URLValidator(schemes=["http", "https"])(url.strip())
        except ValidationError:
            errors["url"] = "must be an http:// or https:// address"
    if run_id not in (None, "") and not (
        isinstance(run_id, int) and Run.objects.filter(pk=run_id, owner=owner).exists()
    ):
        errors["run"] = "must be the id of one of your runs, or null for all of them"
    if errors:
        raise WebhookInputError(errors)
    return Webhook.objects.create(owner=owner, url=url.strip(), run_id=run_id or None)


def queue_deliveries(alert: Alert, change: str, wire: dict) -> list[WebhookDelivery]:
    hooks = Webhook.objects.filter(owner_id=alert.run.owner_id).filter(Q(run__isnull=True) | Q(run_id=alert.run_id))
    payload = {"event": f"alert.{change}", "alert": wire}
    deliveries = [WebhookDelivery.objects.create(webhook=hook, alert=alert, payload=payload) for hook in hooks]
    for delivery in deliveries:
        transaction.on_commit(lambda pk=delivery.pk: deliver_webhook.delay(pk))
    return deliveries


def try_delivery(delivery: WebhookDelivery) -> bool:
    """One POST; True when the receiver took it (2xx). The outcome is saved either way."""
    request = urllib.request.Request(
        delivery.webhook.url,
        data=json.dumps(delivery.payload).encode(),
        headers={"Content-Type": "application/json", "User-Agent": "loom-alerts"},
        method="POST",
    )
    delivery.tries += 1
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            delivery.last_status, delivery.last_error = response.status, ""
    except urllib.error.HTTPError as error:
        delivery.last_status, delivery.last_error = error.code, f"HTTP {error.code} {error.reason}"
    except (OSError, ValueError) as error:
        delivery.last_status, delivery.last_error = None, f"{type(error).__name__}: {error}"
    delivered = delivery.last_status is not None and 200 <= delivery.last_status < 300
    if delivered or delivery.tries >= settings.LOOM_WEBHOOK_TRIES:
        delivery.state = WebhookDelivery.DELIVERED if delivered else WebhookDelivery.FAILED
        delivery.finished_at = timezone.now()
    delivery.save(update_fields=["tries", "last_status", "last_error", "state", "finished_at"])
    return delivered


def retry_wait_s(tries: int) -> float:
    return settings.LOOM_WEBHOOK_RETRY_BASE_S * 2 ** (tries - 1)


@shared_task(name="loom.alerts.deliver_webhook", bind=True, acks_late=False, ignore_result=True)
def deliver_webhook(self, delivery_id: int) -> None:
    """POST once; on failure try again after LOOM_WEBHOOK_RETRY_BASE_S, doubling, LOOM_WEBHOOK_TRIES in all."""
    delivery = WebhookDelivery.objects.select_related("webhook").filter(pk=delivery_id).first()
    if delivery is None or delivery.state != WebhookDelivery.PENDING:
        return
    if not try_delivery(delivery) and delivery.state == WebhookDelivery.PENDING:
        self.apply_async(args=[delivery_id], countdown=retry_wait_s(delivery.tries))
