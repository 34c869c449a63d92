"""fp8 matmuls for training (compute.precision fp8): torchao's float8 training converts the blocks' linear layers,
which then cast their inputs, weights and output gradients to fp8 with tensorwise or rowwise scales
(compute.fp8_scaling) and multiply with torch._scaled_mm; master weights, optimizer states and everything else stay
as bf16 mixed precision keeps them. The output projection stays bf16 (its logits feed the loss), as torchtitan
leaves it; so do the MoE experts (grouped GEMMs) and the router. Under tensor parallelism the converted layers take
PyTorch's usual styles and cast their local shards.

PyTorch's scaled matmul runs on GPUs of compute capability 8.9 and later (Ada, Hopper, Blackwell) and, slowly, on
CPUs, which is where the tests run it."""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

FP8_CAPABILITY = (8, 9)
# torch._scaled_mm needs both dims of each operand to be multiples of 16.
FP8_ALIGNMENT = 16


def fp8_refusal(device: torch.device) -> str | None:
    """Why compute.precision fp8 cannot run on this device, or None where it can."""
    if device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)
    if capability >= FP8_CAPABILITY:
        return None
    name = torch.cuda.get_device_name(device)
    return (
        f"compute.precision: fp8 needs a GPU of compute capability 8.9 or later (Ada, Hopper, Blackwell); "
        f"{name} is {capability[0]}.{capability[1]}: use bf16"
    )


def in_fp8(name: str, module: nn.Module) -> bool:
    """A block's linear layer whose shape the scaled matmul takes."""
    return (
        isinstance(module, nn.Linear)
        and name.startswith("blocks.")
        and module.in_features % FP8_ALIGNMENT == 0
        and module.out_features % FP8_ALIGNMENT == 0
    )


def apply_float8(model: nn.Module, scaling: str) -> int:
    """Swap the blocks' linear layers for torchao's Float8Linear with the named scaling recipe; returns how many."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted = sum(in_fp8(name, module) for name, module in model.named_modules())
    config = Float8LinearConfig.from_recipe_name(scaling)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: in_fp8(name, module))
    logger.info("fp8 matmuls (%s scaling) in %d linear layers", scaling, converted)
    return converted
