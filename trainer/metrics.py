"""Throughput, model FLOPs utilisation and memory, as each rank reports them every step.

MFU convention (PaLM, appendix B): model FLOPs per token = 6·N + 12·L·h·s, where N counts every
parameter except the input embedding table (a lookup, not a matmul), L is layers, h the hidden
size and s the sequence length (the attention-score term). Recomputation is not counted: MFU
measures the model's work, not the hardware's. The achieved FLOP/s of a rank is that per-token
cost times the step's global tokens over the step time, divided by the world size."""

from __future__ import annotations

import resource

import torch
from torch.distributed.tensor import DTensor

from trainer.config import ModelConfig

# Dense peak FLOP/s per GPU type for bf16 tensor-core math (vendor datasheets, without sparsity).
PEAK_BF16_FLOPS = {
    "A100": 312e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H200": 989e12,
    "B200": 2250e12,
}
PAGE_BYTES = resource.getpagesize()


def model_flops_per_token(model: ModelConfig, non_embedding_params: int) -> float:
    return 6 * non_embedding_params + 12 * model.layers * model.dim * model.seq_len


def peak_flops(device: torch.device) -> float | None:
    """The GPU's bf16 peak from its name (longest matching key wins: "H100 PCIe" before "H100");
    None on CPUs and unknown GPUs, where MFU is not reported."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    matches = [key for key in PEAK_BF16_FLOPS if key in name]
    return PEAK_BF16_FLOPS[max(matches, key=len)] if matches else None


def mfu(flops_per_token: float, global_tokens: int, step_time_s: float, world_size: int, peak: float | None):
    if peak is None:
        return None
    return flops_per_token * global_tokens / step_time_s / world_size / peak


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def state_bytes(parameters: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of model state this rank holds: its shards of the parameters, their gradients and the
    optimizer's states (the step counts included). The planner predicts exactly these."""
    states = [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    return {
        "parameter_bytes": sum(_local_bytes(parameter) for parameter in parameters),
        "gradient_bytes": sum(_local_bytes(p.grad) for p in parameters if p.grad is not None),
        "optimizer_bytes": sum(_local_bytes(value) for value in states),
    }


def memory(device: torch.device) -> dict[str, int]:
    """Bytes: the CUDA caching allocator's view on GPUs; the process's resident set on CPUs."""
    if device.type == "cuda":
        return {
            "memory_allocated": torch.cuda.memory_allocated(device),
            "memory_peak": torch.cuda.max_memory_allocated(device),
            "memory_reserved": torch.cuda.memory_reserved(device),
        }
    with open("/proc/self/statm") as statm:
        resident = int(statm.read().split()[1]) * PAGE_BYTES
    # ru_maxrss is in KiB on Linux and only updated now and then, so it can trail the current size.
    peak = max(resident, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"memory_rss": resident, "memory_peak_rss": peak}


def own_work(step_time_s: float, comm_s: float) -> dict[str, float]:
    """The step split by the collective recorder: seconds in collectives (issue to completion, summed; ops
    that overlap each count in full) and the rest, the rank's own work. A rank the others wait for spends
    the least in collectives and has the most own work, so it stands out where step times, equal across
    ranks that synchronise every step, do not."""
    return {"comm_s": comm_s, "compute_s": max(0.0, step_time_s - comm_s)}
