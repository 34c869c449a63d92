"""What pages show of webhook deliveries: each of a user's webhooks with its latest deliveries and how many
of them ever failed (the webhooks page), and a run's deliveries that failed or are still being retried (its
triage page). The deliveries themselves are made in webhooks.py."""

from django.db.models import Count, Prefetch, Q

from loom.runs.models import Run

from .models import Webhook, WebhookDelivery

# Deliveries shown under each webhook, and on a run's triage page: the newest.
RECENT_DELIVERIES = 20
UNDELIVERED_SHOWN = 20


def webhooks_of(user) -> list[Webhook]:
    """The user's webhooks, each with `failed_deliveries` (how many in all) and `recent_deliveries`."""
    recent = WebhookDelivery.objects.select_related("alert__run")[:RECENT_DELIVERIES]
    failed = Count("deliveries", filter=Q(deliveries__state=WebhookDelivery.FAILED))
    return list(
        Webhook.objects.filter(owner=user)
        .select_related("run")
        .annotate(failed_deliveries=failed)
        .prefetch_related(Prefetch("deliveries", queryset=recent, to_attr="recent_deliveries"))
    )


def undelivered(run: Run) -> tuple[list[WebhookDelivery], int]:
    """Deliveries of the run's alerts that failed or are still being retried: the newest UNDELIVERED_SHOWN,
    and how many there are in all."""
    deliveries = WebhookDelivery.objects.filter(
        alert__run=run, state__in=[WebhookDelivery.FAILED, WebhookDelivery.PENDING]
    ).select_related("alert", "webhook")
    return list(deliveries[:UNDELIVERED_SHOWN]), deliveries.count()
