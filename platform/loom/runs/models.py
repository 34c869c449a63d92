from django.conf import settings
from django.db import models

from . import states


class Run(models.Model):
    """A training job as the user asked for it; each launch of it is an Attempt."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="runs")
    name = models.CharField(max_length=200)
    config = models.JSONField()
    # What the planner predicted for this config on the cluster it was created for; null when it
    # was created without one.
    estimate = models.JSONField(null=True, blank=True)
    # The checkpoint this run was forked from (restored into a new run); null for a fresh run.
    forked_from = models.ForeignKey(
        "checkpoints.Checkpoint", on_delete=models.SET_NULL, null=True, blank=True, related_name="forks"
    )
    # The registered dataset its config's data.dataset names, and the imported model its checkpoint.init_from
    # starts from; null for the demo corpus and for fresh weights or another run's checkpoint.
    dataset = models.ForeignKey(
        "datasets.Dataset", on_delete=models.SET_NULL, null=True, blank=True, related_name="runs"
    )
    pretrained = models.ForeignKey(
        "datasets.PretrainedModel", on_delete=models.SET_NULL, null=True, blank=True, related_name="runs"
    )
    state = models.CharField(max_length=20, choices=states.CHOICES, default=states.QUEUED)
    # The highest event seq handed out; events take seq numbers under a row lock on the run.
    last_seq = models.BigIntegerField(default=0)
    # Whatever its owner wants to remember about it (what it tried, what came of it).
    note = models.TextField(blank=True)
    # When its owner archived it: an archived run leaves the run list but keeps everything, and is restored by
    # clearing this; null while it is live.
    archived_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["owner", "-created_at"])]

    def __str__(self) -> str:
        return f"run {self.pk} {self.name}"


class RunTag(models.Model):
    """A label its owner put on a run ("baseline", "lr-sweep"), to find it by in the run list."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="tags")
    name = models.CharField(max_length=40)

    class Meta:
        ordering = ["name"]
        constraints = [models.UniqueConstraint(fields=["run", "name"], name="run_tag_unique_per_run")]

    def __str__(self) -> str:
        return self.name


class Attempt(models.Model):
    """One launch of a run as a torchrun process group."""

    CREATED = "created"
    RESTART = "restart"
    RESTORE = "restore"
    TRIGGERS = [CREATED, RESTART, RESTORE]

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveIntegerField()
    # The config this attempt runs: the run's, or, for a restore, with another layout and a resume path.
    config = models.JSONField()
    # Why it exists: the run was created, an automatic restart, or a restore someone asked for.
    trigger = models.CharField(max_length=16, choices=[(t, t) for t in TRIGGERS], default=CREATED)
    trigger_note = models.TextField(blank=True)
    # The checkpoint it resumed from (as its trainer reported loading it); null when it started fresh.
    restored_from = models.ForeignKey(
        "checkpoints.Checkpoint", on_delete=models.SET_NULL, null=True, blank=True, related_name="restored_into"
    )
    state = models.CharField(max_length=20, choices=states.CHOICES, default=states.QUEUED)
    # SHA-256 of the per-attempt token the launcher minted when it claimed the attempt;
    # empty until then, which is also what makes claiming idempotent.
    token_hash = models.CharField(max_length=64, blank=True, db_index=True)
    cancel_requested = models.BooleanField(default=False)
    exit_code = models.IntegerField(null=True, blank=True)
    failure_reason = models.TextField(blank=True)
    # How the launcher classified a failure (failures.py: killed, segfault, lost_peer, collective_timeout,
    # gpu_error, worker_lost, out_of_memory, invalid_config, exception, unknown) and whether the restart
    # policy may retry it.
    failure_kind = models.CharField(max_length=32, blank=True)
    retryable = models.BooleanField(null=True, blank=True)
    # What the restart policy did after this attempt failed, in words ("restarted as attempt 3 …").
    restart_decision = models.TextField(blank=True)
    work_dir = models.CharField(max_length=500, blank=True)
    # The launch backend it was submitted to (loom.runs.backends) and that backend's handle for it (a pid
    # and its start time, a Slurm job id): stored before anything else happens to it, so any process can
    # observe or cancel it, whoever submitted it and whatever became of them.
    backend = models.CharField(max_length=16, blank=True)
    backend_handle = models.JSONField(null=True, blank=True)
    # Why the backend has not started it yet, as the backend says ("Resources", "Priority"); empty once it runs.
    pending_reason = models.CharField(max_length=200, blank=True)
    # The nodes its ranks ran on, as the backend named them, and those it must not run on beyond the
    # backend's excluded nodes: a restart after a node failure avoids the node that failed.
    nodes = models.JSONField(default=list, blank=True)
    avoid_nodes = models.JSONField(default=list, blank=True)
    # When its launch message was last handed to the broker: the reconciler sends it again when a queued
    # attempt waited too long (the broker was down when it was created, or the message was lost).
    launch_sent_at = models.DateTimeField(null=True, blank=True)
    # The last step the alert watcher has judged (loom.alerts.watch): the trainer's retention keeps a checkpoint
    # until the steps up to the next one are judged, since an alert there would pin it.
    alerts_judged_through = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run", "number"]
        constraints = [models.UniqueConstraint(fields=["run", "number"], name="attempt_number_unique_per_run")]

    def __str__(self) -> str:
        return f"run {self.run_id} attempt {self.number}"


class ExcludedNode(models.Model):
    """A node the next launches leave out (Slurm's --exclude): by a person's button, or automatically once
    attempts failed on it restart.exclude_after_failures times."""

    backend = models.CharField(max_length=16)
    name = models.CharField(max_length=200)
    reason = models.TextField()
    # Null when loom excluded it by itself.
    excluded_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True)
    excluded_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["backend", "name"], name="excluded_node_unique_per_backend")]

    def __str__(self) -> str:
        return f"{self.backend} node {self.name} (excluded)"
