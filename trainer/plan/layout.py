"""The quantities every estimate derives from a validated run config."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Literal

from trainer.config import ModelConfig, RunConfig

# Bytes per activation element by precision; fp8 keeps matmul inputs in 1 byte (Transformer
# Engine saves its fp8 casts for backward) and everything else in bf16.
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp8": 2}
MATMUL_INPUT_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}
# How the trainer's mesh places ranks, innermost first (trainer/parallel/mesh.py).
PLACEMENT = ("tp", "cp", "dp_shard", "dp_replicate", "pp")
RUNTIMES = ("loom", "megatron", "torchtitan")
Runtime = Literal["loom", "megatron", "torchtitan"]
Attention = Literal["flash", "flash2", "unfused"]


@dataclass(frozen=True)
class Layout:
    config: RunConfig
    runtime: Runtime = "loom"
    """Whose training code runs the layout: loom's trainer, or one the planner exports to (Megatron-LM,
    torchtitan). They differ in what each fuses, overlaps, recomputes and keeps."""
    attention: Attention = "flash"
    """How the runtime computes attention: one fused flash kernel (loom's SDPA, Megatron-LM since 2023); the same
    with FlashAttention-2's kernels (PyTorch's SDPA on Hopper through 2025, as torchtitan's published runs had it); or
    unfused as Megatron-LM did in 2021–2022: QKᵀ and AV as batched products around a softmax and dropout that
    read and write the whole score matrix."""

    @property
    def model(self):
        return self.config.model

    def with_blocks(self, model: ModelConfig) -> Layout:
        """This layout for a model whose blocks are all `model`'s (`ModelConfig.dense_blocks`: a mixture of
        experts' dense blocks), to price one kind of block."""
        if model == self.model:
            return self
        return replace(self, config=self.config.model_copy(update={"model": model}))

    @property
    def parallel(self):
        return self.config.parallel

    @cached_property
    def precision(self) -> str:
        """auto means bf16: the planner prices GPUs."""
        precision = self.config.compute.precision
        return "bf16" if precision == "auto" else precision

    @property
    def sequence_parallel(self) -> bool:
        """Whether sequence parallelism is in effect: asked for, and tp > 1 to split the sequence over."""
        return self.parallel.sequence_parallel and self.parallel.tp > 1

    @property
    def pipeline_ranks(self) -> int:
        return self.parallel.pp

    @property
    def stages_per_rank(self) -> int:
        return self.parallel.stages_per_rank if self.parallel.pp > 1 else 1

    @property
    def total_stages(self) -> int:
        return self.parallel.pp * self.stages_per_rank

    @property
    def microbatches(self) -> int:
        return self.parallel.microbatches if self.parallel.pp > 1 else 1

    @property
    def micro_seqs(self) -> int:
        """Sequences in one microbatch (b)."""
        return self.config.data.micro_batch // self.microbatches

    @property
    def local_seq(self) -> int:
        """Tokens of each sequence one rank holds (s): the sequence split over cp."""
        return self.model.seq_len // self.parallel.cp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.config.global_batch

    @property
    def accumulation_steps(self) -> int:
        """Forward and backward passes (each over every microbatch) whose gradients one step sums."""
        return self.config.accumulation_steps

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.model.seq_len

    @property
    def activation_bytes(self) -> int:
        return ACTIVATION_BYTES[self.precision]

    @property
    def matmul_input_bytes(self) -> int:
        return MATMUL_INPUT_BYTES[self.precision]

    @property
    def compute_bytes(self) -> int:
        """Bytes of a parameter as the matmuls read it (FSDP gathers it in this dtype)."""
        return 4 if self.precision == "fp32" else 2

    @property
    def keeps_fp32_master_parameters(self) -> bool:
        """loom's trainer (DDP, FSDP2 at every ZeRO stage) keeps fp32 parameters and gradients and computes in
        bf16 on the fly; ZeRO-1/2 elsewhere (Megatron's distributed optimizer, DeepSpeed) keep bf16 parameters
        and gradients, with the fp32 master copy inside the optimizer states."""
        return self.precision == "fp32" or self.zero_at_rest in (0, 3)

    @property
    def zero_at_rest(self) -> int:
        """The ZeRO stage whose sharding a rank's states keep between steps. loom's trainer runs ZeRO-1 and 2 on
        FSDP2 (trainer/parallel/data.py), so between steps they are ZeRO-3's: parameters, gradients and optimizer
        states all sharded; within a step they differ from it in when they gather and reduce."""
        zero = self.parallel.zero
        return 3 if self.runtime == "loom" and zero in (1, 2) else zero

    @property
    def autocast(self) -> bool:
        """loom's trainer runs bf16 as autocast where FSDP does not cast the parameters (trainer/parallel/apply.py)."""
        return self.runtime == "loom" and self.precision == "bf16" and not self.parallel.fully_shards

    @property
    def residual_bytes(self) -> int:
        """The residual stream's element size: under autocast the embedding returns fp32, and the stream the
        blocks add to stays fp32."""
        return 4 if self.autocast else self.activation_bytes

    @property
    def fused_kernels(self) -> bool:
        """Whether the norms and SwiGLU keep only what fused kernels keep (a norm's input and statistics, the
        gate and up): Megatron-LM (Transformer Engine) and torchtitan (PyTorch's RMSNorm, bf16 parameters
        under FSDP) always; loom's trainer unless compute.kernels says torch (trainer/parallel/apply.py): its
        torch ops keep fp32 intermediates. Under tensor parallelism with compile the trainer compiles torch's ops,
        and they are priced as such: what inductor keeps of them is not measured."""
        if self.runtime != "loom":
            return True
        compiled_tensor_parallel = self.parallel.tp > 1 and self.config.compute.compile
        return self.config.compute.kernels != "torch" and not compiled_tensor_parallel

    @property
    def fused_passes(self) -> bool:
        """Whether norms, rotary and the MLP's activation each run as one fused kernel (trainer.plan.passes):
        Megatron-LM's Transformer Engine always; torchtitan and loom under torch.compile; loom where its Triton
        kernels run. Otherwise eager PyTorch runs them op by op."""
        if self.runtime == "megatron" or self.config.compute.compile:
            return True
        return self.runtime == "loom" and self.fused_kernels

    @property
    def fused_loss(self) -> bool:
        """loom's chunked cross-entropy (no full logits) runs in the model or its last pipeline stage, under tp
        over each rank's share of the vocabulary where loss_parallel is on (trainer/parallel/apply.py); torchtitan
        computes the loss on the whole logits, cast to fp32."""
        parallel = self.parallel
        return self.runtime == "loom" and (parallel.tp == 1 or parallel.loss_parallel)
