"""The run-config schema: one document for the designer, the API, the CLI and the trainer.

Pure pydantic, no torch: the platform imports this module to validate what users send.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from trainer.pipeline_split import splits

BYTE_VOCAB = 256


class _Section(BaseModel):
    # Strict: "5" or true is no step count, and a bool no learning rate (an int for a float is fine);
    # infinities and NaN are no setting's meaning; an unknown field is a typo, never ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _no_nul(cls, value: Any) -> Any:
        # Paths and names go to the file system and PostgreSQL, which both refuse NUL.
        if isinstance(value, str) and "\x00" in value:
            raise ValueError("must not contain a NUL character")
        return value


ROPE_BASE = 10_000.0
"""model.rope_theta's default: Llama 2's base, the one loom's models have always been built with."""
NORM_EPS = 1e-5
"""model.norm_eps's default: the epsilon RMSNorm adds to the mean square before the square root."""


class RopeScaling(_Section):
    """Llama 3.1's stretch of the rotary frequencies to a longer context: wavelengths shorter than
    original_context / high_freq_factor stay, those longer than original_context / low_freq_factor are divided
    by factor, and the ones between blend the two."""

    factor: float = Field(8.0, gt=1, le=1024, description="How much the low frequencies are slowed down.")
    low_freq_factor: float = Field(1.0, gt=0, le=1024, description="original_context / this: the longest kept.")
    high_freq_factor: float = Field(4.0, gt=0, le=1024, description="original_context / this: the shortest scaled.")
    original_context: int = Field(
        8192, ge=1, le=16_777_216, description="The context length the model was first trained at."
    )

    @field_validator("high_freq_factor")
    @classmethod
    def _high_above_low(cls, high: float, info: ValidationInfo) -> float:
        low = info.data.get("low_freq_factor")
        if low is not None and high <= low:
            raise ValueError(f"must be above low_freq_factor={low:g}")
        return high


class MoEConfig(_Section):
    """How a mixture-of-experts block routes its tokens (with model.experts > 1): a router scores every expert per
    token, the top_k best are chosen, and their gates weight the experts' outputs."""

    gate: Literal["softmax", "sigmoid"] = Field(
        "softmax",
        description="How router scores become gates: softmax over experts (Mixtral) or sigmoid (DeepSeek-V3).",
    )
    renormalize: bool = Field(
        True, description="Rescale the chosen experts' gates to sum to 1 (Mixtral, DeepSeek-V3); false keeps them."
    )
    balance_loss: float = Field(
        0.01,
        ge=0,
        le=10,
        description=(
            "Weight of the sequence-wise load-balancing loss (1 × weight when every expert gets its share of each "
            "sequence, more when some get more); 0 = none."
        ),
    )
    bias_update_rate: float = Field(
        0.0,
        ge=0,
        le=1,
        description=(
            "DeepSeek-V3's auxiliary-loss-free balancing: after each step every expert's routing bias moves this "
            "much towards equal load (the bias picks experts, it never weights them); 0 = off."
        ),
    )
    shared_expert: bool = Field(
        False,
        description=(
            "Also send every token through one more expert of the same size, outside the routing (DeepSeek-V3, "
            "Llama 4); its output adds to the routed experts'."
        ),
    )
    capacity_factor: float | None = Field(
        None,
        gt=0,
        le=64,
        description=(
            "Tokens an expert takes from one sequence, as a multiple of its even share (sequence length × top_k / "
            "experts); the later ones past it are dropped and ride the residual. null: dropless."
        ),
    )
    dense_layers: int = Field(
        0,
        ge=0,
        le=512,
        description=(
            "The first this many blocks keep a dense feed-forward block, the rest are mixtures of experts "
            "(DeepSeek-V3: 3)."
        ),
    )
    dense_ffn: int | None = Field(
        None,
        ge=8,
        le=262144,
        description="Inner size of those dense blocks' feed-forward (DeepSeek-V3: 9 × an expert's); null: model.ffn.",
    )


class ModelConfig(_Section):
    """A Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention."""

    layers: int = Field(2, ge=1, le=512, description="Number of transformer blocks.")
    dim: int = Field(128, ge=8, le=65536, description="Hidden size of the residual stream.")
    heads: int = Field(4, ge=1, le=512, description="Attention (query) heads; must divide dim.")
    kv_heads: int = Field(
        2, ge=1, le=512, description="Key/value heads for grouped-query attention; must divide heads."
    )
    ffn: int = Field(
        344,
        ge=8,
        le=262144,
        description="Inner size of the feed-forward block (of each expert in a mixture of experts).",
    )
    vocab: int = Field(
        BYTE_VOCAB, ge=BYTE_VOCAB, le=1_000_000, description="Vocabulary size; at least 256 for byte-level tokens."
    )
    seq_len: int = Field(128, ge=8, le=1_048_576, description="Tokens per training sequence.")
    rope_theta: float = Field(
        ROPE_BASE,
        gt=0,
        le=1e9,
        description="Base of the rotary position embedding's frequencies: 10,000 in Llama 2, 500,000 in Llama 3.",
    )
    mlp: Literal["swiglu", "gelu"] = Field(
        "swiglu", description="Feed-forward block: gated SwiGLU (three matrices) or GELU (two, as in GPT-3)."
    )
    rope_scaling: RopeScaling | None = Field(
        None, description="Llama 3.1's rotary frequency scaling (imported with such a model); null: none."
    )
    norm_eps: float = Field(
        NORM_EPS, gt=0, le=0.1, description="Epsilon RMSNorm adds to the mean square (1e-5 in Llama 2, 1e-6 in some)."
    )
    tie_embeddings: bool = Field(False, description="Share one matrix between the token embedding and the output.")
    parallel_blocks: bool = Field(
        False,
        description=(
            "Attention and the feed-forward block side by side on one norm's output, both added to the residual "
            "stream at once (GPT-J, PaLM, Falcon): x + attention(norm(x)) + mlp(norm(x)); false: one after the "
            "other, each behind a norm of its own (Llama)."
        ),
    )
    experts: int = Field(
        1, ge=1, le=1024, description="Feed-forward experts per block (mixture of experts); 1 = dense."
    )
    top_k: int = Field(1, ge=1, le=64, description="Experts each token is routed to; at most experts.")
    moe: MoEConfig = Field(default_factory=MoEConfig, description="Routing of mixture-of-experts blocks.")

    @property
    def feed_forward_paths(self) -> int:
        """Feed-forward experts each token goes through: top_k routed ones and the shared one, or the dense block."""
        return self.top_k + self.moe.shared_expert if self.experts > 1 else 1

    def is_moe_block(self, index: int) -> bool:
        """Whether block `index` routes its tokens to experts (the first moe.dense_layers stay dense)."""
        return self.experts > 1 and index >= self.moe.dense_layers

    @property
    def dense_blocks(self) -> ModelConfig:
        """The model a dense block of this one belongs to: no experts, and a mixture of experts' first
        moe.dense_layers blocks take their own inner size (moe.dense_ffn)."""
        if self.experts == 1:
            return self
        return self.model_copy(update={"experts": 1, "top_k": 1, "ffn": self.moe.dense_ffn or self.ffn})

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

    @field_validator("top_k")
    @classmethod
    def _top_k_within_experts(cls, top_k: int, info: ValidationInfo) -> int:
        experts = info.data.get("experts")
        if experts is not None and top_k > experts:
            raise ValueError(f"must be at most experts={experts}")
        return top_k


PIPELINE_SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
# How many stages each pipeline rank holds under each schedule: one; several, placed round-robin
# ("looped"); or exactly two, placed as a V (rank r holds stage r and stage 2·pp−1−r).
ONE_STAGE_SCHEDULES = frozenset({"GPipe", "1F1B"})
LOOPED_SCHEDULES = frozenset({"Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"})
V_SCHEDULES = frozenset({"ZBVZeroBubble", "DualPipeV"})
# Schedules PyTorch runs in rounds of microbatches // pp microbatches each.
ROUND_SCHEDULES = frozenset({"Interleaved1F1B", "InterleavedZeroBubble"})


class ParallelConfig(_Section):
    """How the job is spread over ranks: world size = pp × dp_replicate × dp_shard × cp × tp.

    Ranks are placed with tp innermost, then cp, dp_shard, dp_replicate and pp outermost."""

    dp_replicate: int = Field(
        1, ge=1, le=4096, description="Model replicas: plain data parallel (DDP), or the replicated dim of HSDP."
    )
    dp_shard: int = Field(
        1, ge=1, le=4096, description="Ranks that shard parameters, gradients and optimizer state (FSDP2); 1 = none."
    )
    tp: int = Field(1, ge=1, le=512, description="Tensor-parallel degree: attention heads and MLP split over ranks.")
    sequence_parallel: bool = Field(
        True, description="With tp > 1, also split norms and residuals along the sequence (saves activations)."
    )
    loss_parallel: bool = Field(
        True, description="With tp > 1, compute the loss on vocabulary-sharded logits, never gathering them."
    )
    pp: int = Field(1, ge=1, le=512, description="Pipeline-parallel degree: consecutive layers split into stages.")
    pp_schedule: Literal[PIPELINE_SCHEDULES] = Field("1F1B", description="The pipeline schedule, by PyTorch's name.")
    stages_per_rank: int = Field(
        1, ge=1, le=64, description="Pipeline stages on each pipeline rank (virtual stages); 2 for V schedules."
    )
    microbatches: int = Field(
        1, ge=1, le=65536, description="Pipeline microbatches that split each rank's batch; at least pp."
    )
    cp: int = Field(1, ge=1, le=512, description="Context-parallel degree: the sequence split over ranks.")
    ep: int = Field(
        1, ge=1, le=1024, description="Expert-parallel degree: MoE experts split over data/context-parallel ranks."
    )
    zero_stage: Literal[0, 1, 2, 3] | None = Field(
        None,
        description=(
            "What the dp_shard × cp ranks shard: 1 optimizer states, 2 also gradients, 3 also parameters (FSDP); "
            "null: 3 when dp_shard × cp > 1, else 0. loom's trainer runs all three on FSDP2; under 1 and 2 it "
            "gathers the parameters whole once per step (1) or pass (2) and reduce-scatters the gradients once per "
            "step (1) or in every pass (2)."
        ),
    )
    reshard_after_forward: bool = Field(
        True,
        description=(
            "ZeRO-3: free gathered parameters after forward (less memory, one more all-gather); ZeRO-1 and 2 never do."
        ),
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Collective backend; auto picks NCCL on CUDA and gloo on CPU."
    )

    @field_validator("zero_stage", mode="before")
    @classmethod
    def _stage_not_bool(cls, stage: Any) -> Any:
        # A Literal of ints compares by equality, so true would pass as stage 1.
        if isinstance(stage, bool):
            raise ValueError("must be 0, 1, 2, 3 or null, not a boolean")
        return stage

    @property
    def sharding_ranks(self) -> int:
        """Ranks that share one copy of the sharded state: FSDP shards over dp_shard × cp."""
        return self.dp_shard * self.cp

    @property
    def zero(self) -> int:
        """The ZeRO stage in effect (zero_stage, or what dp_shard and cp imply)."""
        if self.zero_stage is not None:
            return self.zero_stage
        return 3 if self.sharding_ranks > 1 else 0

    @property
    def reshards_after_forward(self) -> bool:
        """Whether FSDP2 frees each block's gathered parameters after its forward: ZeRO-3 as configured;
        ZeRO-1 and 2 hold them whole through the pass."""
        return self.reshard_after_forward and self.zero not in (1, 2)

    @property
    def data_parallel(self) -> int:
        """Ranks that see different data: the batch is split dp_replicate × dp_shard ways."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def data_parallel_path(self) -> Literal["none", "ddp", "fsdp", "hsdp"]:
        """How loom's trainer keeps the data-parallel ranks in step: "fsdp" (FSDP2 over dp_shard × cp),
        "hsdp" (FSDP2 on the 2-D dp_replicate × (dp_shard × cp) mesh), "ddp", or "none" (one replica).

        DDP takes only replicas of the whole model: it cannot take tensor-parallel (DTensor) parameters,
        and under a pipeline schedule its reducer breaks on the second microbatch's backward. Those
        replicas take HSDP with one shard per replica (dp_shard × cp = 1), which is plain replication
        with gradients averaged over dp_replicate."""
        if self.dp_replicate > 1:
            return "ddp" if self.world_size == self.dp_replicate else "hsdp"
        return "fsdp" if self.sharding_ranks > 1 else "none"

    @property
    def fully_shards(self) -> bool:
        """Whether FSDP2 (fully_shard) holds the parameters and reduces the gradients."""
        return self.data_parallel_path in ("fsdp", "hsdp")


class ComputeConfig(_Section):
    """How each rank computes: precision, activation recompute, compilation and kernels."""

    precision: Literal["auto", "fp32", "bf16", "fp8"] = Field(
        "auto",
        description=(
            "bf16 mixed precision (fp32 master weights and reductions), fp8 matmuls on top of it, or fp32; "
            "auto is bf16 on CUDA."
        ),
    )
    fp8_scaling: Literal["tensorwise", "rowwise"] = Field(
        "tensorwise",
        description=(
            "With precision fp8: one scale per tensor (fastest), or one per row (closer to bf16, slower); torchao's "
            "float8 training recipes."
        ),
    )
    recompute: Literal["none", "selective", "full"] = Field(
        "none",
        description="Activation checkpointing: none; selective (attention recomputed); full (whole blocks).",
    )
    recompute_every: int = Field(
        1,
        ge=1,
        le=1024,
        description=(
            "Recompute only every N-th block (blocks 0, N, 2N, …; the others keep all their activations), as "
            "torchtitan's per-layer selective checkpointing; 1: every block."
        ),
    )
    compile: bool = Field(False, description="torch.compile each transformer block.")
    kernels: Literal["auto", "triton", "torch"] = Field(
        "auto", description="Fused Triton kernels (auto: on CUDA) or plain torch."
    )

    def recomputes_block(self, index: int) -> bool:
        """Whether the block at this index of the whole model recomputes (compute.recompute_every)."""
        return self.recompute != "none" and index % self.recompute_every == 0


class OptimizerConfig(_Section):
    """AdamW with linear warmup then cosine decay."""

    lr: float = Field(3e-3, gt=0, le=1, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate as a fraction of lr.")
    warmup_steps: int = Field(5, ge=0, description="Steps of linear warmup from 0 to lr.")
    weight_decay: float = Field(0.1, ge=0, le=1, description="Decoupled weight decay on matrices.")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW first-moment decay.")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW second-moment decay.")
    grad_clip: float = Field(1.0, ge=0, description="Global gradient-norm clip; 0 disables clipping.")
    offload: bool = Field(False, description="Keep optimizer states and master weights in CPU memory (ZeRO-Offload).")
    on_non_finite: Literal["skip", "stop", "continue"] = Field(
        "skip",
        description=(
            "When a step's global gradient norm is NaN or infinite (so is its loss, or will be): skip = every rank "
            "drops the step's gradients and keeps its parameters (the step is reported, marked update_skipped); "
            "stop = the run fails at that step, before the update; continue = apply it anyway."
        ),
    )


DATASET_REFERENCE_PREFIX = "dataset:"


class DataConfig(_Section):
    """What the run trains on: a prepared token dataset, or the demo corpus every Python ships (the standard
    library's own sources as byte-level tokens), which needs no preparation."""

    dataset: str | None = Field(
        None,
        min_length=1,
        description=(
            "A prepared token dataset (`python -m trainer.data prepare`); null: the demo corpus. The trainer run on "
            'its own takes the directory prepare wrote; through the platform, "dataset:<id>" names a registered '
            "dataset of yours, which the platform turns into its directory."
        ),
    )
    document_mask: bool = Field(
        False,
        description=(
            "Keep attention within documents: a token after an end-of-text token sees nothing before it (needs a "
            "dataset; not with pipeline or context parallelism yet). false: sequences packed across documents "
            "attend across their boundaries, as GPT-style pretraining does."
        ),
    )
    corpus: Literal["python-stdlib"] = Field("python-stdlib", description="The demo corpus (without a dataset).")
    corpus_bytes: int = Field(
        2_000_000, ge=10_000, le=200_000_000, description="How many bytes of the demo corpus to train on."
    )
    micro_batch: int = Field(
        8,
        ge=1,
        le=65536,
        description="Sequences per data-parallel rank per forward and backward pass (tp, cp and pp ranks share them).",
    )
    global_batch: int | None = Field(
        None,
        ge=1,
        le=16_777_216,
        description=(
            "Sequences per optimizer step: a multiple of micro_batch × data-parallel ranks, the quotient being the "
            "gradient-accumulation steps; null: micro_batch × data-parallel ranks (no accumulation)."
        ),
    )
    seed: int = Field(0, ge=0, description="Seed for data order and weight initialisation.")
    skip_steps: list[tuple[int, int]] = Field(
        default_factory=list,
        description=(
            "Ranges [first, last] of the steps whose batches are never trained on: from `first` on, each step "
            "takes the batch of the step after the range, as operators did to step past a loss spike's data."
        ),
    )

    @field_validator("skip_steps", mode="before")
    @classmethod
    def _ranges_from_json(cls, ranges: Any) -> Any:
        # JSON has no tuples: a stored or posted range is a list, which strict validation takes as a tuple only here.
        if isinstance(ranges, list):
            return [tuple(pair) if isinstance(pair, list) else pair for pair in ranges]
        return ranges

    @field_validator("skip_steps")
    @classmethod
    def _ranges_run_forward(cls, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        for first, last in ranges:
            if first < 1 or last < first:
                raise ValueError(f"[{first}, {last}] must be [first, last] with 1 <= first <= last")
        return sorted(ranges)


class CheckpointConfig(_Section):
    """Periodic, atomically committed checkpoints that resume into any layout (trainer/checkpoint.py).

    Saving is on when interval_steps or interval_minutes is set; then a stopped run (SIGTERM) saves
    its last completed step and a finished run its final step."""

    interval_steps: int = Field(0, ge=0, description="Save every N steps; 0 = no step-based saves.")
    interval_minutes: float = Field(
        0, ge=0, le=10_080, description="Also save when this many minutes have passed since the last save; 0 = never."
    )
    keep_last: int = Field(3, ge=1, description="How many of the newest committed checkpoints to keep.")
    keep_every: int = Field(
        0, ge=0, description="Also keep every checkpoint whose step is a multiple of this, forever; 0 = none."
    )
    directory: str | None = Field(
        None,
        min_length=1,
        description=(
            "Where checkpoints live; null: $LOOM_CHECKPOINT_DIR, else `checkpoints` in the working directory. "
            "For the trainer run on its own only: the platform refuses a config that sets it and places each "
            "attempt's checkpoints in a directory of its own."
        ),
    )
    resume: str | None = Field(
        None,
        min_length=1,
        description=(
            'null: start fresh; "latest": the newest committed checkpoint in the directory that verifies '
            "(falling back past corrupt ones; fresh when there is none); the path of one checkpoint (step-NNNNNN); "
            "or the path of a directory of checkpoints (such as another attempt's directory): the newest one there "
            "that verifies, falling back past corrupt ones, and an error when none does. Paths are for the trainer "
            'run on its own: through the platform, resume is "latest" or names a committed checkpoint of your own, '
            '"checkpoint:<id>" or "run:<id>/step:<n>", which the platform turns into its path.'
        ),
    )
    init_from: str | None = Field(
        None,
        min_length=1,
        description=(
            "Model weights to start from, at step 1 with a fresh optimizer (a resumed attempt loads its own "
            "checkpoint instead). The trainer run on its own takes a committed checkpoint's directory (an imported "
            'Hugging Face model included: `python -m trainer.hf import`); through the platform "checkpoint:<id>" '
            '(a committed checkpoint of yours) or "model:<id>" (a pretrained model you imported).'
        ),
    )
    async_save: bool = Field(
        True,
        description=(
            "Block training only while state is copied to host memory, then write in the background; "
            "false writes while training waits."
        ),
    )

    @property
    def saves(self) -> bool:
        """Whether this run writes checkpoints at all (periodic, final and on SIGTERM)."""
        return self.interval_steps > 0 or self.interval_minutes > 0


class EvalConfig(_Section):
    """Validation loss: batches of the validation split, forward only, in the run's own layout."""

    interval_steps: int = Field(
        0, ge=0, le=10_000_000, description="Evaluate after every N steps and after the last one; 0 = never."
    )
    batches: int = Field(
        4,
        ge=1,
        le=100_000,
        description=(
            "Batches of micro_batch × data-parallel ranks sequences per evaluation, the same sequences every time "
            "(the demo corpus holds its validation text out beyond corpus_bytes)."
        ),
    )


class TelemetryConfig(_Section):
    """How each rank reports to the platform."""

    flush_interval_s: float = Field(0.5, gt=0, le=60, description="Longest time an event waits before it is sent.")
    heartbeat_interval_s: float = Field(5.0, gt=0, le=600, description="Seconds between liveness heartbeats.")
    comm: bool = Field(
        True,
        description="Record every collective and send a rank × rank traffic matrix (tens of µs each; see README).",
    )
    comm_window_steps: int = Field(10, ge=1, le=100_000, description="Steps summed into one traffic matrix.")


class FaultsConfig(_Section):
    """Failures injected on purpose, to rehearse what the platform does when a rank dies, hangs, slows down,
    diverges or finds a checkpoint damaged. Every fault is off by default; one at a step past `steps` never fires."""

    crash_at_step: int | None = Field(None, ge=1, description="Raise an error on crash_rank at this step; null never.")
    crash_rank: int = Field(0, ge=0, description="The rank that crashes; must be below the world size.")
    kill_at_step: int | None = Field(
        None,
        ge=1,
        description=(
            "kill_rank sends itself SIGKILL as this step starts, before any of its collectives: the retryable "
            "crash of a lost process; null never."
        ),
    )
    kill_rank: int = Field(0, ge=0, description="The rank that kills itself; must be below the world size.")
    hang_at_step: int | None = Field(
        None,
        ge=1,
        description=(
            "hang_rank stops making progress as this step starts and sleeps until it is killed, while its "
            "heartbeats go on, like a rank stuck in a collective; the other ranks wait for it; null never."
        ),
    )
    hang_rank: int = Field(0, ge=0, description="The rank that hangs; must be below the world size.")
    slow_rank: int | None = Field(
        None,
        ge=0,
        description="The rank that sleeps slow_ms in every step (a straggler the others wait for); null: none.",
    )
    slow_ms: int = Field(
        0, ge=0, le=600_000, description="Milliseconds slow_rank sleeps inside every timed step; 0 = not slowed."
    )
    slow_from_step: int = Field(
        1, ge=1, description="The first step slow_rank is slowed in (the others, waiting for it, slow down with it)."
    )
    nan_at_step: int | None = Field(
        None,
        ge=1,
        description=(
            "At this step the loss and every gradient become NaN on every rank, as in a loss spike; what follows "
            "is optimizer.on_non_finite's (skip: the update is dropped; continue: the parameters diverge); null never."
        ),
    )
    spike_at_step: int | None = Field(
        None,
        ge=1,
        description=(
            "At this step every rank's loss and gradients are multiplied by spike_factor, as a bad batch would "
            "(the clipped update stays bounded); null never."
        ),
    )
    spike_factor: float = Field(20.0, gt=1, le=1e6, description="How much spike_at_step multiplies loss and gradients.")
    leak_mb_per_step: float = Field(
        0.0,
        ge=0,
        le=1024,
        description="Every rank keeps this many MiB more memory alive after each step, a leak; 0 = none.",
    )
    corrupt_checkpoint_step: int | None = Field(
        None,
        ge=1,
        description=(
            "Once the checkpoint of this step is committed, rank 0 flips one byte of one of its data files, "
            "so loading it fails verification; must be a step that is saved; null never."
        ),
    )


class RestartConfig(_Section):
    """What the platform does when an attempt fails (the trainer itself ignores this section)."""

    max_restarts: int = Field(
        3,
        ge=0,
        le=100,
        description=(
            "Automatic restarts from the latest good checkpoint after a retryable failure (a rank killed, "
            "a lost peer, the supervising worker gone); out of memory, an invalid config or a Python "
            "exception stop the run. 0 = never restart."
        ),
    )
    exclude_after_failures: int = Field(
        2,
        ge=0,
        le=100,
        description=(
            "Leave a node out of every later launch once this many attempts failed on it through the node's "
            "own fault (it went down, or its ranks were lost), so restarts go to the healthy nodes. "
            "0 = never exclude automatically."
        ),
    )


class AlertsConfig(_Section):
    """When the platform raises an alert while the run trains (the trainer itself ignores this section).
    Spikes are judged by a robust z-score: how many scaled median absolute deviations a value lies above the
    median of the `window` steps before it."""

    enabled: bool = Field(True, description="Run the detectors on this run's telemetry; false: no alerts at all.")
    window: int = Field(
        50, ge=5, le=10_000, description="Steps of history behind a step that spikes and drops are judged against."
    )
    min_history: int = Field(
        10, ge=3, le=10_000, description="Steps of history a spike or drop needs before it is judged at all."
    )

    loss_spike_z: float = Field(
        6.0, gt=0, description="A step's loss this many robust deviations above its window's median is a spike."
    )
    loss_spike_factor: float = Field(
        10.0,
        gt=1,
        description="A loss above this multiple of the highest loss of its window is a spike (Megatron's rule).",
    )
    loss_spike_rise: float = Field(
        0.25,
        ge=0,
        description="A loss spike by z-score must also lie this fraction above the median, so calm windows stay calm.",
    )
    grad_norm_spike_z: float = Field(
        6.0, gt=0, description="A gradient norm this many robust deviations above its window's median is a spike."
    )
    grad_norm_spike_ratio: float = Field(
        5.0,
        ge=1,
        description=(
            "A gradient-norm spike must also be this multiple of the median: early in training norms swing 2–3× "
            "from step to step."
        ),
    )
    throughput_drop: float = Field(
        0.3,
        gt=0,
        lt=1,
        description="Tokens/s this fraction below the window's median, throughput_drop_steps steps running, is a drop.",
    )
    throughput_drop_steps: int = Field(3, ge=1, le=1000, description="Consecutive slow steps that make a drop.")
    throughput_drop_min_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description=(
            "A drop must also last this many seconds of training (more slow steps when steps are short): a few "
            "steps slowed by a checkpoint save or a busy host are not a drop."
        ),
    )
    memory_warmup_steps: int = Field(
        10,
        ge=0,
        description="Memory creep ignores the first steps, whose allocations (optimizer state, caches) are expected.",
    )
    memory_creep: float = Field(
        0.1,
        gt=0,
        description=(
            "Memory creep: a rank's memory over the last third of the window this fraction above the first third, "
            "rising in each third."
        ),
    )
    straggler_score: float = Field(
        0.7,
        gt=0,
        lt=1,
        description=(
            "A rank whose step time is above the step's median over the ranks of its pipeline stage divided by this, "
            "straggler_steps steps running, is a straggler (the score nvidia-resiliency-ext uses: median / own time "
            "below 0.7)."
        ),
    )
    straggler_steps: int = Field(5, ge=1, le=1000, description="Consecutive slow steps that make a straggler.")
    straggler_min_excess_s: float = Field(
        0.05,
        ge=0,
        le=3600,
        description=(
            "A straggler's step time must also be this many seconds above the median: on steps of tens of "
            "milliseconds a rank a few milliseconds slower (its host busy, rank 0's own logging) costs the run nothing."
        ),
    )
    straggler_min_s: float = Field(
        10.0,
        ge=0,
        le=3600,
        description=(
            "A straggler must also have been slow for this many seconds of its own time (more steps when steps are "
            "short): a rank whose host is busy for a few short steps is slow for a moment, not a straggler."
        ),
    )
    hang_after_s: float = Field(
        120.0,
        gt=0,
        le=86_400,
        description=(
            "A rank with no heartbeat, or a run with no step completed, for this many seconds is hung (checked every "
            "LOOM_HANG_CHECK_INTERVAL_S by the platform's periodic task)."
        ),
    )
    hang_grace_s: float = Field(
        600.0,
        gt=0,
        le=86_400,
        description=(
            "Until the first step completes (building the model, compiling, loading a checkpoint) a hang needs this "
            "many seconds since the attempt started instead."
        ),
    )
    clear_after_steps: int = Field(
        20,
        ge=1,
        le=100_000,
        description="An open alert whose condition has not been seen for this many steps resolves by itself.",
    )
    overfit_evaluations: int = Field(
        3,
        ge=1,
        le=1000,
        description=(
            "Overfitting: validation loss (eval.interval_steps) higher at this many evaluations in a row than at "
            "the one before each, while training loss fell over the same steps."
        ),
    )
    overfit_rise: float = Field(
        0.01,
        ge=0,
        le=10,
        description=(
            "Overfitting also needs the latest validation loss this fraction above the one those evaluations "
            "started from: a hair's rise is no trend."
        ),
    )
    expert_collapse_share: float = Field(
        0.01,
        ge=0,
        lt=1,
        description=(
            "Expert collapse: an expert of a mixture-of-experts layer that receives under this fraction of an even "
            "share of its layer's tokens (the mean load of the layer's experts), expert_collapse_steps steps "
            "running, has collapsed. 0.01 is under 1 % of what an even split would give it: relative to the even "
            "share, so that it means the same with 8 experts as with 256 (where 1 % of all tokens is more than any "
            "expert's even share); 0 = off."
        ),
    )
    expert_collapse_steps: int = Field(
        20, ge=1, le=1000, description="Consecutive steps an expert must stay under expert_collapse_share."
    )
    expert_imbalance_ratio: float = Field(
        4.0,
        ge=0,
        le=1024,
        description=(
            "Expert load imbalance: a mixture-of-experts layer whose busiest expert receives over this multiple of "
            "the layer's mean load, expert_imbalance_steps steps running, is imbalanced (the ratio can reach the "
            "number of experts: one expert taking every token); 0 = off."
        ),
    )
    expert_imbalance_steps: int = Field(
        20, ge=1, le=1000, description="Consecutive steps a layer must stay over expert_imbalance_ratio."
    )

    @field_validator("expert_imbalance_ratio")
    @classmethod
    def _imbalance_above_even(cls, ratio: float) -> float:
        if 0 < ratio <= 1:
            raise ValueError(
                "must be above 1 (the busiest expert always receives at least the mean load), or 0 to turn the rule off"
            )
        return ratio

    @field_validator("min_history")
    @classmethod
    def _history_within_window(cls, min_history: int, info: ValidationInfo) -> int:
        window = info.data.get("window")
        if window is not None and min_history > window:
            raise ValueError(f"must be at most window={window}")
        return min_history


class RunConfig(_Section):
    """Everything a run needs; the same document is validated by the API and by the trainer."""

    steps: int = Field(100, ge=1, le=10_000_000, description="Optimizer steps to train.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    compute: ComputeConfig = Field(default_factory=ComputeConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    restart: RestartConfig = Field(default_factory=RestartConfig)
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)

    @property
    def sequences_per_pass(self) -> int:
        """Sequences one forward and backward pass of every data-parallel rank takes together."""
        return self.data.micro_batch * self.parallel.data_parallel

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.data.global_batch or self.sequences_per_pass

    @property
    def accumulation_steps(self) -> int:
        """Forward and backward passes whose gradients each optimizer step sums."""
        return self.global_batch // self.sequences_per_pass

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.model.seq_len


class ConfigError(ValueError):
    """A run config that failed validation; `errors` maps dotted field paths to messages."""

    def __init__(self, errors: dict[str, str]):
        self.errors = errors
        super().__init__("; ".join(f"{field}: {message}" for field, message in errors.items()))


# What strict validation's type errors would have taken, as a JSON document spells it.
STRICT_TYPE_MESSAGES = {
    "int_type": "must be a valid integer",
    "float_type": "must be a valid number",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "finite_number": "must be a finite number",
}


def json_spelling(value: Any) -> str:
    """A refused value as a JSON document writes it: true, "5", null, Infinity (shortened past 40 characters)."""
    if isinstance(value, dict | list):
        return "an object" if isinstance(value, dict) else "an array"
    written = json.dumps(value)
    return written if len(written) <= 40 else written[:37] + "..."


def field_errors(error: ValidationError) -> dict[str, str]:
    """Flatten pydantic's errors into {"model.heads": "must divide dim=128; ..."}."""
    errors: dict[str, str] = {}
    for item in error.errors():
        path = ".".join(str(part) for part in item["loc"]) or "config"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "is not a known field"
        elif item["type"] in STRICT_TYPE_MESSAGES:
            message = f"{STRICT_TYPE_MESSAGES[item['type']]}, not {json_spelling(item.get('input'))}"
        errors.setdefault(path, message.removeprefix("Value error, "))
    return errors


def parse_config(document: Any, *, runnable: bool = True) -> RunConfig:
    """Validate a run-config document, raising ConfigError with field-level messages.

    runnable=False accepts layouts the planner can estimate but this trainer cannot run yet (expert
    parallelism across replicas, with an ep that does not divide dp_shard × cp; offload; an expert capacity
    under context parallelism); launching always checks runnable."""
    if not isinstance(document, dict):
        raise ConfigError({"config": "must be a JSON object"})
    try:
        config = RunConfig.model_validate(document)
    except ValidationError as error:
        raise ConfigError(field_errors(error)) from None
    errors = cross_section_errors(config)
    if runnable:
        errors = unrunnable_errors(config) | errors
    if errors:
        raise ConfigError(errors)
    return config


def unrunnable_errors(config: RunConfig) -> dict[str, str]:
    """Fields the planner estimates but this trainer does not run yet, keyed by field."""
    model, parallel = config.model, config.parallel
    reasons = {
        "parallel.ep": (
            parallel.ep > 1 and parallel.sharding_ranks % parallel.ep != 0,
            f"the trainer spreads experts over the dp_shard × cp = {parallel.sharding_ranks} ranks that shard the "
            f"model; use a divisor of it",
        ),
        "model.moe.capacity_factor": (
            model.experts > 1 and model.moe.capacity_factor is not None and parallel.cp > 1,
            "an expert's capacity is counted over whole sequences, which context parallelism splits; use null "
            "(dropless) or cp 1",
        ),
        "optimizer.offload": (config.optimizer.offload, "the trainer keeps optimizer states on the device"),
    }
    return {field: message for field, (unrunnable, message) in reasons.items() if unrunnable}


def world_size_of(document: dict) -> int:
    """Ranks a stored (already validated) run config needs."""
    return RunConfig.model_validate(document).parallel.world_size


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cross_section_errors(config: RunConfig) -> dict[str, str]:
    """Rules that relate fields of different sections, keyed by the field a user should change.

    The trainer checks these before any process group exists; the API and the planner reuse them."""
    errors: dict[str, str] = {}
    model, parallel, data = config.model, config.parallel, config.data

    def refuse(field: str, message: str) -> None:
        errors.setdefault(field, message)

    if data.dataset is None and data.corpus_bytes < model.seq_len + 1:
        minimum = model.seq_len + 1
        refuse("data.corpus_bytes", f"must be at least model.seq_len + 1 = {minimum} to cut one training window")
    if data.document_mask:
        if data.dataset is None:
            refuse("data.document_mask", "needs data.dataset: the demo corpus has no end-of-text tokens")
        elif parallel.pp > 1 or parallel.cp > 1:
            refuse(
                "data.document_mask",
                "is not supported with parallel.pp > 1 or parallel.cp > 1 yet (the mask follows the token ids, which "
                "later pipeline stages and other context ranks do not see); use false",
            )
    per_pass = config.sequences_per_pass
    if data.global_batch is not None and data.global_batch % per_pass:
        near = data.global_batch // per_pass
        valid = [per_pass * k for k in range(max(1, near - 2), near + 4)]
        refuse(
            "data.global_batch",
            f"must be a multiple of data.micro_batch × data-parallel ranks = {data.micro_batch} × "
            f"{parallel.data_parallel} = {per_pass}; valid choices near it: {valid}",
        )
    if model.moe.dense_layers and model.experts == 1:
        refuse("model.moe.dense_layers", "needs a mixture-of-experts model (model.experts > 1); use 0")
    elif model.moe.dense_layers >= model.layers:
        refuse("model.moe.dense_layers", f"must be below model.layers={model.layers}, or the model has no experts")
    if parallel.tp > 1:
        dense_ffn = model.dense_blocks.ffn
        sizes = (("heads", model.heads), ("kv_heads", model.kv_heads), ("ffn", model.ffn), ("moe.dense_ffn", dense_ffn))
        for name, size in sizes:
            if size % parallel.tp:
                valid = [
                    d
                    for d in divisors(model.heads)
                    if model.kv_heads % d == 0 and model.ffn % d == 0 and dense_ffn % d == 0
                ]
                refuse("parallel.tp", f"must divide model.{name}={size}; valid choices are {valid}")
        if model.vocab % parallel.tp:
            valid = divisors(model.vocab)[:12]
            refuse("parallel.tp", f"must divide model.vocab={model.vocab}; valid choices include {valid}")
    sequence_splits = []
    if parallel.cp > 1:
        sequence_splits.append((2 * parallel.cp, f"2 × cp = {2 * parallel.cp} load-balanced chunks"))
    if parallel.tp > 1 and parallel.sequence_parallel:
        sequence_splits.append((parallel.tp, f"tp = {parallel.tp} sequence-parallel shards"))
    elif parallel.tp > 1 and model.experts > 1:
        sequence_splits.append((parallel.tp, f"tp = {parallel.tp} shards the experts' router takes"))
    split = math.prod(size for size, _ in sequence_splits)
    if model.seq_len % split:
        reasons = " × ".join(reason for _, reason in sequence_splits)
        refuse("model.seq_len", f"must be divisible by {split} ({reasons})")
    _pipeline_errors(config, refuse)
    _sharding_errors(config, refuse)
    if config.compute.recompute_every > 1 and config.compute.recompute == "none":
        refuse("compute.recompute_every", "needs compute.recompute 'full' or 'selective' (which blocks recompute what)")
    elif config.compute.recompute_every > model.layers:
        refuse("compute.recompute_every", f"must be at most model.layers={model.layers}")
    if config.compute.compile and parallel.tp > 1 and config.compute.recompute == "selective":
        refuse(
            "compute.compile",
            "cannot be combined with parallel.tp > 1 and compute.recompute 'selective' (torch 2.13 computes wrong "
            "gradients for it from its compile cache); use recompute 'full' or 'none', or compile false",
        )
    _fault_errors(config, refuse)
    return errors


def _fault_errors(config: RunConfig, refuse) -> None:
    faults, world_size = config.faults, config.parallel.world_size
    for name in ("crash_rank", "kill_rank", "hang_rank", "slow_rank"):
        rank = getattr(faults, name)
        if rank is not None and rank >= world_size:
            refuse(f"faults.{name}", f"must be below the world size {world_size}")
    step, checkpoint = faults.corrupt_checkpoint_step, config.checkpoint
    if step is None:
        return
    if not checkpoint.saves:
        refuse(
            "faults.corrupt_checkpoint_step",
            f"no checkpoint is saved at step {step}: checkpointing is off; set checkpoint.interval_steps",
        )
    elif step != config.steps and not (checkpoint.interval_steps and step % checkpoint.interval_steps == 0):
        # Saves by the clock land on steps no one can name in advance; the final step is always saved.
        interval = checkpoint.interval_steps
        fix = (
            f"use a multiple of {interval} or the final step {config.steps}"
            if interval
            else f"use the final step {config.steps} or set checkpoint.interval_steps"
        )
        refuse(
            "faults.corrupt_checkpoint_step",
            f"no checkpoint is saved at step {step} (checkpoint.interval_steps is {interval}); {fix}",
        )


def _pipeline_errors(config: RunConfig, refuse) -> None:
    parallel, layers = config.parallel, config.model.layers
    if parallel.pp == 1:
        if parallel.stages_per_rank != 1:
            refuse("parallel.stages_per_rank", "must be 1 without pipeline parallelism (pp = 1)")
        if parallel.microbatches != 1:
            refuse("parallel.microbatches", "must be 1 without pipeline parallelism (pp = 1)")
        return
    schedule = parallel.pp_schedule
    if schedule in ONE_STAGE_SCHEDULES and parallel.stages_per_rank != 1:
        refuse("parallel.stages_per_rank", f"must be 1 for {schedule}; use Interleaved1F1B or LoopedBFS for more")
    if schedule in LOOPED_SCHEDULES and parallel.stages_per_rank < 2:
        refuse("parallel.stages_per_rank", f"must be at least 2 for {schedule}; with 1 stage per rank use 1F1B")
    if schedule in V_SCHEDULES and parallel.stages_per_rank != 2:
        refuse("parallel.stages_per_rank", f"must be 2 for {schedule}: each rank holds two stages, placed as a V")
    stages = parallel.pp * parallel.stages_per_rank
    if not splits(layers, stages):
        valid = [p for p in range(2, layers + 3) if splits(layers, p * parallel.stages_per_rank)]
        refuse(
            "parallel.pp",
            f"pp × stages_per_rank = {stages} must divide model.layers={layers}, or {layers + 2} (the embedding and "
            f"the output counted as a block each: the first and last stages hold one block fewer); valid pp here: "
            f"{valid}",
        )
    microbatches = parallel.microbatches
    if microbatches < parallel.pp:
        refuse("parallel.microbatches", f"must be at least pp={parallel.pp} to keep every stage busy")
    elif schedule in ROUND_SCHEDULES and microbatches % (microbatches // parallel.pp):
        rounds = microbatches // parallel.pp
        valid = [n for n in range(parallel.pp, 4 * parallel.pp + 1) if n % (n // parallel.pp) == 0]
        refuse(
            "parallel.microbatches",
            f"must be a multiple of microbatches // pp = {rounds} for {schedule} (PyTorch runs it in rounds of "
            f"about pp microbatches); valid choices include {valid}",
        )
    if schedule == "DualPipeV" and microbatches < 2 * parallel.pp:
        refuse("parallel.microbatches", f"must be at least 2 × pp = {2 * parallel.pp} for DualPipeV")
    if config.data.micro_batch % parallel.microbatches:
        valid = [m for m in divisors(config.data.micro_batch) if m >= parallel.pp]
        refuse(
            "parallel.microbatches",
            f"must divide data.micro_batch={config.data.micro_batch}; valid choices are {valid}",
        )


def _sharding_errors(config: RunConfig, refuse) -> None:
    parallel, experts = config.parallel, config.model.experts
    if parallel.zero_stage == 0 and parallel.sharding_ranks > 1:
        refuse(
            "parallel.zero_stage",
            f"dp_shard × cp = {parallel.sharding_ranks} ranks shard the model (ZeRO-3); use 3 or null, or dp_shard 1",
        )
    if parallel.zero_stage in (1, 2, 3) and parallel.sharding_ranks == 1:
        refuse("parallel.zero_stage", "needs dp_shard × cp > 1 ranks to shard over; use 0 or null")
    if parallel.ep > 1:
        if experts == 1:
            refuse("parallel.ep", "needs a mixture-of-experts model (model.experts > 1); use 1")
        elif experts % parallel.ep:
            refuse("parallel.ep", f"must divide model.experts={experts}; valid choices are {divisors(experts)}")
        expert_ranks = parallel.data_parallel * parallel.cp
        if expert_ranks % parallel.ep:
            valid = [d for d in divisors(expert_ranks) if experts % d == 0]
            refuse(
                "parallel.ep",
                f"must divide dp_replicate × dp_shard × cp = {expert_ranks} (experts spread over those ranks); "
                f"valid choices are {valid}",
            )
