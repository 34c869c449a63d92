from django.conf import settings
from django.db import models
from django.db.models import Q

from loom.runs.models import Attempt, Run


class Alert(models.Model):
    """Something wrong with a run, from open to acknowledged to resolved. A run has at most one alert per
    rule and rank that is not resolved: a condition seen again updates it (`occurrences`, `last_step`)."""

    OPEN = "open"
    ACKNOWLEDGED = "acknowledged"
    RESOLVED = "resolved"
    STATES = [OPEN, ACKNOWLEDGED, RESOLVED]
    LIVE = [OPEN, ACKNOWLEDGED]

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="alerts", db_index=False)
    attempt = models.ForeignKey(Attempt, on_delete=models.SET_NULL, null=True, related_name="alerts")
    rule = models.CharField(max_length=32, help_text="The detector that raised it (detectors.py).")
    rank = models.IntegerField(null=True, help_text="The rank it is about; null: the run as a whole.")
    key = models.CharField(max_length=64, help_text="rule and rank: what one live alert per run stands for.")
    severity = models.CharField(max_length=16)
    state = models.CharField(max_length=16, choices=[(state, state) for state in STATES], default=OPEN)
    step = models.BigIntegerField(help_text="The step it was first seen at.")
    last_step = models.BigIntegerField(help_text="The latest step its condition was seen at.")
    ranks = models.JSONField(default=list, help_text="Every rank involved.")
    host = models.CharField(max_length=255, blank=True, help_text="The node of `rank`, when known.")
    message = models.TextField()
    details = models.JSONField(default=dict)
    occurrences = models.PositiveIntegerField(default=1)
    opened_at = models.DateTimeField(auto_now_add=True)
    last_seen_at = models.DateTimeField(auto_now_add=True)
    acknowledged_at = models.DateTimeField(null=True)
    acknowledged_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True)
    resolved_at = models.DateTimeField(null=True)
    resolution = models.CharField(
        max_length=255, blank=True, help_text="Why it was resolved: its condition cleared, or who resolved it."
    )

    class Meta:
        ordering = ["-opened_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["run", "key"], condition=~Q(state="resolved"), name="one_live_alert_per_rule_and_rank"
            )
        ]
        indexes = [models.Index(fields=["run", "state"], name="alert_by_run_state")]


class Webhook(models.Model):
    """Where a user's alerts are POSTed as JSON: for all their runs (run null) or one run."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="webhooks")
    run = models.ForeignKey(Run, on_delete=models.CASCADE, null=True, blank=True, related_name="webhooks")
    url = models.URLField(max_length=2000)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]


class WebhookDelivery(models.Model):
    """One alert change to one webhook, with every try's outcome: failures stay visible."""

    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"

    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="deliveries")
    alert = models.ForeignKey(Alert, on_delete=models.CASCADE, related_name="deliveries")
    payload = models.JSONField()
    state = models.CharField(max_length=16, default=PENDING)
    tries = models.PositiveIntegerField(default=0)
    last_status = models.IntegerField(null=True, help_text="The HTTP status of the last try; null: no answer.")
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True)

    class Meta:
        ordering = ["-id"]
