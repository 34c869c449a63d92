from django.conf import settings
from django.db import models

from loom.runs.models import Attempt, Run

COMMITTED = "committed"
CORRUPT = "corrupt"
DELETED = "deleted"
STATES = [COMMITTED, CORRUPT, DELETED]


class Checkpoint(models.Model):
    """A checkpoint an attempt committed, as its `checkpoint` events describe it. Only committed ones
    can be restored; corrupt (a load found a damaged file) and deleted (retention, or replaced by a
    later save of the same step under the same name) stay for the lineage."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="checkpoints")
    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="checkpoints")
    step = models.BigIntegerField()
    path = models.CharField(max_length=1000)
    bytes = models.BigIntegerField(default=0)
    # The parallel section of the config it was saved under, and that layout's world size.
    layout = models.JSONField(default=dict)
    world_size = models.PositiveIntegerField(default=1)
    # The checkpoint this one's attempt had restored or saved before it; null for the first of a lineage.
    parent = models.ForeignKey("self", on_delete=models.SET_NULL, null=True, blank=True, related_name="children")
    state = models.CharField(max_length=16, choices=[(state, state) for state in STATES], default=COMMITTED)
    loss = models.FloatField(null=True, blank=True)
    # Seconds training was blocked by the save, and seconds until it was committed.
    stall_s = models.FloatField(null=True, blank=True)
    save_s = models.FloatField(null=True, blank=True)
    problem = models.TextField(blank=True, help_text="Why it is corrupt or was deleted.")
    committed_at = models.DateTimeField(help_text="When the trainer committed it.")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["run", "step", "id"]
        indexes = [models.Index(fields=["run", "step"]), models.Index(fields=["path"])]

    def __str__(self) -> str:
        return f"run {self.run_id} checkpoint step {self.step} ({self.state})"


class Pin(models.Model):
    """A person's word that retention must keep a checkpoint, until they take it back. Alerts pin the
    checkpoint triage offers them without a row: an alert's pin lasts exactly as long as it is live
    (services.pins_of)."""

    checkpoint = models.ForeignKey(Checkpoint, on_delete=models.CASCADE, related_name="user_pins")
    pinned_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="checkpoint_pins")
    pinned_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["checkpoint", "pinned_by"], name="one_pin_per_checkpoint_and_user")
        ]
