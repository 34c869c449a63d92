"""parallelize(): every form of parallelism applied to the model in one place and a fixed order.

TP (+SP, loss parallel) → activation checkpointing → torch.compile per block → FSDP2/HSDP or DDP;
PP first cuts the model into stages and the rest is applied to each stage. (Under TP with full recompute
the blocks are compiled before they are checkpointed: compiled.py says why.)"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from trainer.config import RunConfig
from trainer.kernels import TORCH_KERNELS, kernels_for
from trainer.model import Transformer

from .compiled import recompute_and_compile
from .context import apply_context_parallel
from .data import apply_ddp, apply_fsdp
from .mesh import ParallelMesh
from .pipeline import build_schedule, split_model
from .tensor import apply_tensor_parallel


@dataclass
class ParallelModel:
    """The parallelized model: the modules this rank holds and how to run one step's forward and backward."""

    modules: list[nn.Module]
    forward_backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]
    state_modules: list[nn.Module] = field(default_factory=list)

    def parameters(self) -> list[nn.Parameter]:
        return [parameter for module in self.modules for parameter in module.parameters()]


def parallelize(model: Transformer, mesh: ParallelMesh, config: RunConfig, device: torch.device) -> ParallelModel:
    parallel = config.parallel
    uses_loss_parallel = parallel.tp > 1 and parallel.loss_parallel
    # Triton kernels take plain tensors: under tensor or context parallelism activations are DTensors
    # or need collectives between ops, so those layouts keep torch's ops (which DTensor understands).
    kernels = kernels_for(config.compute.kernels, device) if parallel.tp == parallel.cp == 1 else TORCH_KERNELS
    model.use_kernels(kernels)
    # Without tensor or pipeline parallelism the model computes its own loss from hidden states,
    # chunk by chunk, never holding the full logits.
    fused_loss = parallel.tp == parallel.pp == 1
    parts = split_model(model, parallel, mesh.pp_rank) if parallel.pp > 1 else [(0, model)]
    param_dtype = torch.bfloat16 if precision_of(config, device) == "bf16" else torch.float32
    wrapped = []
    positions = None
    for _, part in parts:
        if parallel.tp > 1:
            apply_tensor_parallel(part, mesh["tp"], parallel.sequence_parallel, parallel.loss_parallel)
        if parallel.cp > 1:
            positions = apply_context_parallel(part, mesh["cp"]).to(device)
        recompute_and_compile(part, config.compute.recompute, config.compute.compile, parallel.tp > 1)
        if parallel.fully_shards:
            apply_fsdp(part, mesh, parallel, param_dtype)
            wrapped.append(part)
        elif parallel.data_parallel_path == "ddp":
            wrapped.append(apply_ddp(part, mesh, device))
        else:
            wrapped.append(part)
    state_modules = [part for _, part in parts]
    autocast = _autocast(config, device)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def loss_context():
        return loss_parallel() if uses_loss_parallel else contextlib.nullcontext()

    if parallel.pp == 1:
        (module,) = wrapped

        def forward_backward(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            with loss_context():
                with autocast():
                    output = module(inputs, targets) if fused_loss else module(inputs)
                loss = output if fused_loss else loss_fn(output, targets)
                loss.backward()
            return loss.detach()

    else:
        feeds_targets = holds_last_stage(parts, parallel)
        schedule = build_schedule(
            list(zip([index for index, _ in parts], wrapped, strict=True)), parallel, mesh, device, loss_fn
        )

        def forward_backward(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
            losses: list[torch.Tensor] = []
            with loss_context(), autocast():
                schedule.step(
                    inputs if mesh.is_first_stage_rank else None,
                    target=targets if feeds_targets else None,
                    losses=losses,
                )
            return torch.stack([loss.detach() for loss in losses]).mean() if losses else None

    if positions is None:
        return ParallelModel(wrapped, forward_backward, state_modules)

    def context_parallel_forward_backward(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        # Each cp rank trains on its load-balanced share of every sequence.
        return forward_backward(inputs[:, positions], targets[:, positions])

    return ParallelModel(wrapped, context_parallel_forward_backward, state_modules)


def holds_last_stage(parts, parallel) -> bool:
    last = parallel.pp * parallel.stages_per_rank - 1
    return any(index == last for index, _ in parts)


def precision_of(config: RunConfig, device: torch.device) -> str:
    if config.compute.precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return config.compute.precision


def _autocast(config: RunConfig, device: torch.device):
    """bf16 autocast where FSDP's mixed-precision policy does not already cast parameters."""
    if precision_of(config, device) == "bf16" and not config.parallel.fully_shards:
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext
