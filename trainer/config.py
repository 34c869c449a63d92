"""The run-config schema: one document for the designer, the API, the CLI and the trainer.

Pure pydantic, no torch: the platform imports this module to validate what users send.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

BYTE_VOCAB = 256


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """A Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention."""

    layers: int = Field(2, ge=1, le=512, description="Number of transformer blocks.")
    dim: int = Field(128, ge=8, le=65536, description="Hidden size of the residual stream.")
    heads: int = Field(4, ge=1, le=512, description="Attention (query) heads; must divide dim.")
    kv_heads: int = Field(
        2, ge=1, le=512, description="Key/value heads for grouped-query attention; must divide heads."
    )
    ffn: int = Field(344, ge=8, le=262144, description="Inner size of the SwiGLU feed-forward block.")
    vocab: int = Field(
        BYTE_VOCAB, ge=BYTE_VOCAB, le=1_000_000, description="Vocabulary size; at least 256 for byte-level tokens."
    )
    seq_len: int = Field(128, ge=8, le=1_048_576, description="Tokens per training sequence.")

    @field_validator("heads")
    @classmethod
    def _heads_divide_dim(cls, heads: int, info: ValidationInfo) -> int:
        dim = info.data.get("dim")
        if dim is not None:
            if dim % heads:
                choices = [h for h in range(1, min(dim, 64) + 1) if dim % h == 0]
                raise ValueError(f"must divide dim={dim}; valid choices include {choices}")
            if (dim // heads) % 2:
                raise ValueError(f"dim/heads = {dim // heads} must be even for rotary embeddings")
        return heads

    @field_validator("kv_heads")
    @classmethod
    def _kv_heads_divide_heads(cls, kv_heads: int, info: ValidationInfo) -> int:
        heads = info.data.get("heads")
        if heads is not None and heads % kv_heads:
            choices = [k for k in range(1, heads + 1) if heads % k == 0]
            raise ValueError(f"must divide heads={heads}; valid choices are {choices}")
        return kv_heads


class ParallelConfig(_Section):
    """How the job is spread over processes. Tensor, pipeline and context degrees come later."""

    dp: int = Field(1, ge=1, le=4096, description="Data-parallel degree: ranks launched, each with a model replica.")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Collective backend; auto picks NCCL on CUDA and gloo on CPU."
    )

    @property
    def world_size(self) -> int:
        return self.dp


class OptimizerConfig(_Section):
    """AdamW with linear warmup then cosine decay."""

    lr: float = Field(3e-3, gt=0, le=1, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate as a fraction of lr.")
    warmup_steps: int = Field(5, ge=0, description="Steps of linear warmup from 0 to lr.")
    weight_decay: float = Field(0.1, ge=0, le=1, description="Decoupled weight decay on matrices.")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW first-moment decay.")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW second-moment decay.")
    grad_clip: float = Field(1.0, ge=0, description="Global gradient-norm clip; 0 disables clipping.")


class DataConfig(_Section):
    """Byte-level text. The corpus ships with every Python: the standard library's own sources."""

    corpus: Literal["python-stdlib"] = Field("python-stdlib", description="Where training text comes from.")
    corpus_bytes: int = Field(2_000_000, ge=10_000, le=200_000_000, description="How many bytes of the corpus to load.")
    micro_batch: int = Field(8, ge=1, le=65536, description="Sequences per rank per step.")
    seed: int = Field(0, ge=0, description="Seed for data order and weight initialisation.")


class CheckpointConfig(_Section):
    """Checkpointing is not implemented yet; these fields reserve its place in the document."""

    interval_steps: int = Field(0, ge=0, description="Save every N steps; 0 saves nothing.")
    keep_last: int = Field(3, ge=1, description="How many recent checkpoints to keep.")


class TelemetryConfig(_Section):
    """How each rank reports to the platform."""

    flush_interval_s: float = Field(0.5, gt=0, le=60, description="Longest time an event waits before it is sent.")
    heartbeat_interval_s: float = Field(5.0, gt=0, le=600, description="Seconds between liveness heartbeats.")


class FaultsConfig(_Section):
    """Failures injected on purpose, to rehearse what the platform does when a rank dies."""

    crash_at_step: int | None = Field(None, ge=1, description="Raise an error on crash_rank at this step; null never.")
    crash_rank: int = Field(0, ge=0, description="The rank that crashes; must be below parallel.dp.")


class RunConfig(_Section):
    """Everything a run needs; the same document is validated by the API and by the trainer."""

    steps: int = Field(100, ge=1, le=10_000_000, description="Optimizer steps to train.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)

    @property
    def tokens_per_step(self) -> int:
        return self.data.micro_batch * self.model.seq_len * self.parallel.world_size


class ConfigError(ValueError):
    """A run config that failed validation; `errors` maps dotted field paths to messages."""

    def __init__(self, errors: dict[str, str]):
        self.errors = errors
        super().__init__("; ".join(f"{field}: {message}" for field, message in errors.items()))


def field_errors(error: ValidationError) -> dict[str, str]:
    """Flatten pydantic's errors into {"model.heads": "must divide dim=128; ..."}."""
    errors: dict[str, str] = {}
    for item in error.errors():
        path = ".".join(str(part) for part in item["loc"]) or "config"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "is not a known field"
        errors.setdefault(path, message.removeprefix("Value error, "))
    return errors


def parse_config(document: Any) -> RunConfig:
    """Validate a run-config document, raising ConfigError with field-level messages."""
    if not isinstance(document, dict):
        raise ConfigError({"config": "must be a JSON object"})
    try:
        config = RunConfig.model_validate(document)
    except ValidationError as error:
        raise ConfigError(field_errors(error)) from None
    errors = cross_section_errors(config)
    if errors:
        raise ConfigError(errors)
    return config


def cross_section_errors(config: RunConfig) -> dict[str, str]:
    """Rules that relate fields of different sections, keyed by the field a user should change."""
    errors = {}
    if config.data.corpus_bytes < config.model.seq_len + 1:
        errors["data.corpus_bytes"] = (
            f"must be at least model.seq_len + 1 = {config.model.seq_len + 1} to cut one training window"
        )
    if config.faults.crash_rank >= config.parallel.world_size:
        errors["faults.crash_rank"] = f"must be below the world size {config.parallel.world_size}"
    return errors
