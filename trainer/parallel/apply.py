"""parallelize(): every form of parallelism applied to the model in one place and a fixed order.

TP (+SP, loss parallel) → CP → EP → activation checkpointing → torch.compile per block → FSDP2/HSDP or DDP;
PP first cuts the model into stages and the rest is applied to each stage. (Under TP with full recompute
the blocks are compiled before they are checkpointed: compiled.py says why.) The result runs a step's
forwards and backwards, in gradient-accumulation passes, and evaluates batches forward only, in any layout."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from trainer.checkpoint import reshard
from trainer.config import RunConfig
from trainer.kernels import TORCH_KERNELS, kernels_for, logits_steps
from trainer.model import Transformer

from .compiled import recompute_and_compile
from .context import apply_context_parallel
from .data import accumulation_pass, apply_ddp, apply_fsdp, reduces_gradients
from .expert import apply_expert_parallel, moe_blocks
from .float8 import apply_float8
from .local_kernels import on_local_shards
from .loss import tensor_parallel_cross_entropy
from .mesh import ParallelMesh
from .moe_tensor import add_up_sequence_parts, split_expert_columns
from .pipeline import build_schedule, forward_only, gradients_reduced, split_model
from .tensor import apply_tensor_parallel
from .tied import TiedEmbeddings


@dataclass
class ParallelModel:
    """The parallelized model: the modules this rank holds, how to run one optimizer step's forwards and
    backwards over this rank's share of the global batch, and how to evaluate a batch without gradients."""

    modules: list[nn.Module]
    forward_backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]
    evaluate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]
    state_modules: list[nn.Module] = field(default_factory=list)
    # Parameters that repeat another's (a pipeline's last-stage copy of the tied embedding): the same gradient and
    # updates, so the gradient norm counts them once.
    copies: list[nn.Parameter] = field(default_factory=list)

    def parameters(self) -> list[nn.Parameter]:
        return [parameter for module in self.modules for parameter in module.parameters()]


def parallelize(model: Transformer, mesh: ParallelMesh, config: RunConfig, device: torch.device) -> ParallelModel:
    """forward_backward takes this rank's share of a step's global batch (micro_batch × accumulation_steps
    sequences) and runs it in accumulation_steps passes, each loss scaled by 1/accumulation_steps so the
    summed gradients are those of the global batch's mean loss; data-parallel gradients are reduced only
    in the last pass, after which a tied embedding's copies across pipeline stages get the sum of their gradients
    (tied.py). It returns the mean loss, unscaled (None on pipeline ranks without the last stage)."""
    parallel = config.parallel
    accumulation_steps = config.accumulation_steps
    # The model (the last pipeline stage) computes its own loss from hidden states, chunk by chunk, never holding
    # the full logits; under tensor parallelism with loss parallel, over each rank's share of the vocabulary.
    # Tensor parallelism without loss parallel gathers the whole logits, as the user asked, and the loss runs on them.
    fused_loss = parallel.tp == 1 or parallel.loss_parallel
    chosen = kernels_for(config.compute.kernels, device)
    kernels = chosen
    if parallel.tp > 1:
        # The norms take DTensors under tensor parallelism, and run on their local rows. Compiled blocks keep
        # torch's ops there, which inductor fuses itself (a Triton kernel on a DTensor's local rows inside
        # torch.compile is not known to compile).
        kernels = TORCH_KERNELS if config.compute.compile else on_local_shards(chosen)
    if parallel.tp > 1 and fused_loss:
        kernels = replace(kernels, cross_entropy=tensor_parallel_cross_entropy(logits_steps(chosen)))
    model.use_kernels(kernels)
    if config.compute.precision == "fp8":
        apply_float8(model, config.compute.fp8_scaling)
    parts = split_model(model, parallel, mesh.pp_rank) if parallel.pp > 1 else [(0, model)]
    param_dtype = torch.bfloat16 if computes_in_bf16(config, device) else torch.float32
    wrapped = []
    positions = None
    for _, part in parts:
        if parallel.tp > 1:
            apply_tensor_parallel(part, mesh["tp"], parallel.sequence_parallel, parallel.loss_parallel)
        if parallel.cp > 1:
            positions = apply_context_parallel(part, mesh["cp"]).to(device)
        if parallel.cp * parallel.tp > 1:
            add_up_sequence_parts(part, mesh["cp_tp"])
        if mesh.experts is not None:
            apply_expert_parallel(part, mesh.experts)
        elif parallel.tp > 1:
            split_expert_columns(part, mesh["tp"])
        recompute_and_compile(part, config.compute, parallel.tp > 1)
        if parallel.fully_shards:
            apply_fsdp(part, mesh, parallel, param_dtype)
            wrapped.append(part)
        elif parallel.data_parallel_path == "ddp":
            wrapped.append(apply_ddp(part, mesh, device))
        else:
            wrapped.append(part)
    state_modules = [part for _, part in parts]
    autocast = _autocast(config, device)
    tied = TiedEmbeddings(parts, parallel, mesh) if config.model.tie_embeddings and parallel.pp > 1 else None

    if parallel.pp == 1:
        (module,) = wrapped

        def mean_loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            with autocast():
                output = module(inputs, targets) if fused_loss else module(inputs)
            return output if fused_loss else cross_entropy(output, targets)

        def forward_backward(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            passes = list(zip(inputs.chunk(accumulation_steps), targets.chunk(accumulation_steps), strict=True))
            scale_balance_losses(state_modules, 1.0 / len(passes))
            losses = []
            for index, (pass_inputs, pass_targets) in enumerate(passes):
                with accumulation_pass(module, parallel.zero, last_pass=index == len(passes) - 1):
                    loss = mean_loss(pass_inputs, pass_targets)
                    (loss / len(passes)).backward()
                losses.append(loss.detach())
            return sum(losses[1:], losses[0]) / len(losses)

        def evaluate(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                loss = mean_loss(inputs, targets)
            reshard(module)
            return loss

    else:
        feeds_targets = holds_last_stage(parts, parallel)
        pipeline_loss = PipelineLoss(fused_loss)
        # The stages' forwards all take the targets as a keyword; only the last one uses them.
        stage_targets = feeds_targets and fused_loss
        schedule = build_schedule(
            list(zip([index for index, _ in parts], wrapped, strict=True)), parallel, mesh, device, pipeline_loss
        )
        # The schedule sums its microbatches' gradients; the loss scales each to the global batch's mean.
        passes_per_step = parallel.microbatches * accumulation_steps

        def run_schedule(run, inputs: torch.Tensor, targets: torch.Tensor, losses: list[torch.Tensor]) -> None:
            """One run of the schedule, its microbatches' losses added to `losses` (the schedule replaces what
            the list it is given holds)."""
            these_losses: list[torch.Tensor] = []
            model_targets = {"targets": targets} if stage_targets else {}
            with autocast():
                run(
                    inputs if mesh.is_first_stage_rank else None,
                    target=targets if feeds_targets else None,
                    losses=these_losses,
                    # The losses are all the step needs of the last stage's outputs.
                    return_outputs=False,
                    **model_targets,
                )
            losses += these_losses

        def forward_backward(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
            losses: list[torch.Tensor] = []
            pipeline_loss.scale = 1.0 / passes_per_step
            scale_balance_losses(state_modules, pipeline_loss.scale)
            passes = list(zip(inputs.chunk(accumulation_steps), targets.chunk(accumulation_steps), strict=True))
            for index, (pass_inputs, pass_targets) in enumerate(passes):
                with gradients_reduced(schedule, reduced=reduces_gradients(parallel.zero, index == len(passes) - 1)):
                    run_schedule(schedule.step, pass_inputs, pass_targets, losses)
            if tied is not None:
                tied.sum_gradients()
            if not losses:
                return None
            return torch.stack([loss.detach() for loss in losses]).mean() * passes_per_step

        def evaluate(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
            losses: list[torch.Tensor] = []
            pipeline_loss.scale = 1.0
            with torch.no_grad(), forward_only(schedule):
                run_schedule(schedule.eval, inputs, targets, losses)
            for stage_module in wrapped:
                reshard(stage_module)
            return torch.stack(losses).mean() if losses else None

    copies = tied.copies if tied is not None else []
    if positions is None:
        return ParallelModel(wrapped, forward_backward, evaluate, state_modules, copies)

    # Each cp rank trains on, and evaluates, its load-balanced share of every sequence.
    def context_parallel_forward_backward(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        return forward_backward(inputs[:, positions], targets[:, positions])

    def context_parallel_evaluate(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        return evaluate(inputs[:, positions], targets[:, positions])

    return ParallelModel(wrapped, context_parallel_forward_backward, context_parallel_evaluate, state_modules, copies)


def scale_balance_losses(modules: list[nn.Module], scale: float) -> None:
    """Weight the MoE balance losses of each forward pass as the pass's language-model loss is weighted."""
    for module in modules:
        for moe in moe_blocks(module):
            moe.balance_loss_scale = scale


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class PipelineLoss:
    """The pipeline schedule's loss function: the mean cross-entropy of a microbatch times `scale`, which the
    step sets (1 / (microbatches × accumulation steps) to train, 1 to evaluate). Where the last stage computes
    the loss itself (`stage_computes_it`), its output is that mean already."""

    def __init__(self, stage_computes_it: bool) -> None:
        self.scale = 1.0
        self.stage_computes_it = stage_computes_it

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = output if self.stage_computes_it else cross_entropy(output, targets)
        return loss * self.scale


def holds_last_stage(parts, parallel) -> bool:
    last = parallel.pp * parallel.stages_per_rank - 1
    return any(index == last for index, _ in parts)


def precision_of(config: RunConfig, device: torch.device) -> str:
    if config.compute.precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return config.compute.precision


def computes_in_bf16(config: RunConfig, device: torch.device) -> bool:
    """bf16 mixed precision, also under fp8 matmuls (which cast from it)."""
    return precision_of(config, device) in ("bf16", "fp8")


def _autocast(config: RunConfig, device: torch.device):
    """bf16 autocast where FSDP's mixed-precision policy does not already cast parameters."""
    if computes_in_bf16(config, device) and not config.parallel.fully_shards:
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext
