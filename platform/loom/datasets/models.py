"""What a run reads and starts from: prepared token datasets, pretrained models imported from Hugging Face, and
exports of committed checkpoints back to Hugging Face's format. Each belongs to one user."""

from django.conf import settings
from django.db import models

QUEUED = "queued"
CONVERTING = "converting"
READY = "ready"
FAILED = "failed"
JOB_STATES = [QUEUED, CONVERTING, READY, FAILED]
JOB_CHOICES = [(state, state) for state in JOB_STATES]


class Dataset(models.Model):
    """A prepared token dataset (`python -m trainer.data prepare`) registered by its directory, with the summary of
    its manifest the pages show without opening it."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="datasets")
    name = models.CharField(max_length=200)
    # Resolved (symlinks followed) when registered, inside one of LOOM_DATA_ROOTS.
    path = models.CharField(max_length=1000)
    vocab_size = models.PositiveIntegerField()
    tokenizer_kind = models.CharField(max_length=16)
    tokenizer_sha256 = models.CharField(max_length=64, blank=True)
    train_tokens = models.BigIntegerField()
    validation_tokens = models.BigIntegerField()
    train_documents = models.BigIntegerField(default=0)
    validation_documents = models.BigIntegerField(default=0)
    shards = models.PositiveIntegerField()
    registered_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-registered_at", "-id"]
        constraints = [models.UniqueConstraint(fields=["owner", "name"], name="dataset_name_unique_per_owner")]

    def __str__(self) -> str:
        return f"dataset {self.pk} {self.name}"

    @property
    def reference(self) -> str:
        """How a run config names it: data.dataset = "dataset:<id>"."""
        return f"dataset:{self.pk}"


class PretrainedModel(models.Model):
    """A Hugging Face Llama directory, converted once (by a worker) into a loom checkpoint that runs start from."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="pretrained_models")
    name = models.CharField(max_length=200)
    source_path = models.CharField(max_length=1000)
    # The converted checkpoint's directory, under LOOM_MODELS_DIR; empty until the conversion is done.
    checkpoint_path = models.CharField(max_length=1000, blank=True)
    # The model section of a run config that takes these weights (ModelConfig's fields).
    model_config = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=16, choices=JOB_CHOICES, default=QUEUED)
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"model {self.pk} {self.name} ({self.state})"

    @property
    def reference(self) -> str:
        """How a run config starts from it: checkpoint.init_from = "model:<id>"."""
        return f"model:{self.pk}"


class CheckpointExport(models.Model):
    """A committed checkpoint written out in Hugging Face's format (config.json and safetensors) by a worker."""

    checkpoint = models.ForeignKey("checkpoints.Checkpoint", on_delete=models.CASCADE, related_name="exports")
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="checkpoint_exports"
    )
    # Under LOOM_EXPORTS_DIR, named after the export's id.
    out_path = models.CharField(max_length=1000, blank=True)
    dtype = models.CharField(max_length=16, default="float32")
    state = models.CharField(max_length=16, choices=JOB_CHOICES, default=QUEUED)
    error = models.TextField(blank=True)
    requested_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-requested_at", "-id"]

    def __str__(self) -> str:
        return f"export {self.pk} of checkpoint {self.checkpoint_id} ({self.state})"
