from django.db import models

from loom.runs.models import Attempt, Run


class Event(models.Model):
    """Everything that happens to a run, in the order the platform stored it (seq)."""

    KINDS = ["metric", "heartbeat", "comm", "log", "checkpoint", "state"]

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="events")
    seq = models.BigIntegerField()
    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, null=True, blank=True, related_name="events")
    kind = models.CharField(max_length=16, choices=[(k, k) for k in KINDS])
    # -1 is the launcher; null is the platform itself (e.g. a cancel request).
    rank = models.IntegerField(null=True, blank=True)
    step = models.BigIntegerField(null=True, blank=True)
    payload = models.JSONField(default=dict)
    time = models.DateTimeField(help_text="When the event was emitted at its source.")
    received_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["run", "seq"]
        constraints = [models.UniqueConstraint(fields=["run", "seq"], name="event_seq_unique_per_run")]

    def as_wire(self) -> dict:
        return {
            "seq": self.seq,
            "kind": self.kind,
            "attempt": self.attempt.number if self.attempt_id else None,
            "rank": self.rank,
            "step": self.step,
            "time": self.time.timestamp(),
            "payload": self.payload,
        }


class IngestBatch(models.Model):
    """Each (attempt, rank, seq) batch is stored once; a retried batch is recognised here."""

    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="batches")
    rank = models.IntegerField()
    seq = models.BigIntegerField()
    event_count = models.IntegerField()
    received_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["attempt", "rank", "seq"], name="batch_unique_per_attempt_rank_seq")
        ]
