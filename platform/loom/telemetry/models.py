from django.db import models

from loom.runs.models import Attempt, Run


class Event(models.Model):
    """Everything that happens to a run, in the order the platform stored it (seq)."""

    KINDS = ["metric", "heartbeat", "comm", "log", "checkpoint", "state"]

    # Foreign keys that lead one of the table's composite indexes get no index of their own: it would be
    # kept up on every insert (thousands a second at 1,024 ranks) and answer nothing the composite does not.
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="events", db_index=False)
    seq = models.BigIntegerField()
    attempt = models.ForeignKey(
        Attempt, on_delete=models.CASCADE, null=True, blank=True, related_name="events", db_index=False
    )
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
        # The comm heatmap reads an attempt's comm events by window; alerts will read heartbeats alike.
        # A page reads the logs and states before its chart snapshot by kind; without this index that
        # scans every metric event of the run.
        # The traffic panel lists an attempt's windows from its lowest rank's comm events: by the first index
        # that meant reading every comm event of the attempt (a million at 1,024 ranks × 10,000 steps, a
        # second per answer); this one holds only comm events, a few percent of the table.
        # The experts panel reads the metric events that carry expert load: one rank per pipeline stage of a
        # mixture-of-experts run sends them, so at 1,024 ranks they are a few in a thousand metric events, which
        # the index by (attempt, kind, step) would make it read every one of.
        indexes = [
            models.Index(fields=["attempt", "kind", "step"], name="event_by_attempt_kind_step"),
            models.Index(fields=["run", "kind", "seq"], name="event_by_run_kind_seq"),
            models.Index(
                fields=["attempt", "rank", "step"], name="event_comm_by_attempt_rank", condition=models.Q(kind="comm")
            ),
            models.Index(
                fields=["attempt", "step"],
                name="event_expert_load_by_step",
                condition=models.Q(kind="metric", payload__has_key="experts"),
            ),
        ]

    def as_wire(self) -> dict:
        return wire(self, self.attempt.number if self.attempt_id else None)


def wire(event: Event, attempt_number: int | None) -> dict:
    """An event as the events API and the websocket give it."""
    return wire_fields(event.seq, event.kind, attempt_number, event.rank, event.step, event.time, event.payload)


def wire_fields(seq: int, kind: str, attempt_number: int | None, rank, step, time, payload: dict) -> dict:
    """The wire form from an event's fields: for events that are not model instances (ingest's write path)."""
    return {
        "seq": seq,
        "kind": kind,
        "attempt": attempt_number,
        "rank": rank,
        "step": step,
        "time": time.timestamp(),
        "payload": payload,
    }


class IngestBatch(models.Model):
    """Each (attempt, rank, seq) batch is stored once; a retried batch is recognised here."""

    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="batches", db_index=False)
    rank = models.IntegerField()
    seq = models.BigIntegerField()
    event_count = models.IntegerField()
    received_at = models.DateTimeField(auto_now_add=True)
    # The stored events' fingerprint (store.content_digest): the same key sent again with other events is a
    # conflict, not a retry. Empty for batches stored before it was recorded.
    digest = models.CharField(max_length=32, blank=True, default="")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["attempt", "rank", "seq"], name="batch_unique_per_attempt_rank_seq")
        ]


class IngestConflict(models.Model):
    """A batch sent under an (attempt, rank, seq) already stored with other events: answered 409 and kept
    here, events and all, since storing it would break exactly-once and dropping it would lose what a rank sent."""

    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="batch_conflicts")
    rank = models.IntegerField()
    seq = models.BigIntegerField()
    digest = models.CharField(max_length=32)
    events = models.JSONField()
    received_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["attempt", "rank", "seq", "digest"], name="conflict_unique_per_content")
        ]


class RankStep(models.Model):
    """One rank's metrics of one step: the `metric` event projected into columns, so the charts of a
    1,024-rank run read indexed rows instead of JSON."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="rank_steps")
    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="rank_steps", db_index=False)
    rank = models.IntegerField()
    step = models.BigIntegerField()
    time = models.DateTimeField(help_text="When the rank emitted the step's metrics.")
    loss = models.FloatField(null=True, help_text="This rank's own loss (ranks that compute one).")
    loss_mean = models.FloatField(null=True, help_text="The loss averaged over the ranks that hold one.")
    grad_norm = models.FloatField(null=True)
    lr = models.FloatField(null=True)
    step_time_s = models.FloatField(null=True)
    tokens_per_s = models.FloatField(null=True, help_text="This rank's batch's tokens per second.")
    mfu = models.FloatField(null=True)
    memory_bytes = models.BigIntegerField(null=True, help_text="CUDA allocated bytes, or resident set on CPUs.")
    memory_peak_bytes = models.BigIntegerField(null=True)
    compute_s = models.FloatField(
        null=True, help_text="The step minus its collectives: the rank's own work (with the collective recorder on)."
    )
    eval_loss = models.FloatField(
        null=True, help_text="Validation loss, on the steps the run evaluated (the same on every rank)."
    )

    class Meta:
        constraints = [models.UniqueConstraint(fields=["attempt", "rank", "step"], name="rank_step_unique")]
        # Rank lines read (attempt, rank, step); heatmaps and bands of a zoomed-in window read
        # (attempt, step). The overfitting detector reads an attempt's latest evaluations: a step in
        # hundreds evaluates, and only those rows are in its index.
        indexes = [
            models.Index(fields=["attempt", "step"], name="rank_step_by_step"),
            models.Index(
                fields=["attempt", "step"], name="rank_step_evaluated", condition=models.Q(eval_loss__isnull=False)
            ),
        ]


class RankTile(models.Model):
    """Per rank, a run of `span` steps summed up (count, sum, min, max of step time, memory and own work),
    kept as metrics arrive: a heatmap or band over 100,000 steps reads a few hundred tiles per rank
    instead of every step, and a spike survives as its tile's max."""

    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="rank_tiles", db_index=False)
    span = models.IntegerField(help_text="Steps per tile: one of TILE_SPANS.")
    bucket = models.BigIntegerField(help_text="step // span")
    rank = models.IntegerField()
    count = models.IntegerField()
    step_time_sum = models.FloatField(null=True)
    step_time_min = models.FloatField(null=True)
    step_time_max = models.FloatField(null=True)
    memory_sum = models.FloatField(null=True)
    memory_min = models.BigIntegerField(null=True)
    memory_max = models.BigIntegerField(null=True)
    compute_sum = models.FloatField(null=True)
    compute_min = models.FloatField(null=True)
    compute_max = models.FloatField(null=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["attempt", "span", "bucket", "rank"], name="rank_tile_unique"),
        ]


class RankStatus(models.Model):
    """What the platform last heard from each rank of an attempt: its host (the node a heatmap
    names), its last heartbeat and step, and how far it had got through its collectives."""

    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="rank_status", db_index=False)
    rank = models.IntegerField()
    host = models.CharField(max_length=255, blank=True)
    pid = models.IntegerField(null=True)
    last_heartbeat = models.DateTimeField(null=True, help_text="When the rank sent it, by the rank's clock.")
    heard_at = models.DateTimeField(null=True, help_text="When the platform stored it, by the platform's clock.")
    last_step = models.BigIntegerField(null=True)
    collectives = models.JSONField(
        null=True, help_text="The heartbeat's collective progress (trainer/collective_progress.py); null: not recorded."
    )

    class Meta:
        constraints = [models.UniqueConstraint(fields=["attempt", "rank"], name="rank_status_unique")]
