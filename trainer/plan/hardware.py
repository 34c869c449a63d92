"""GPU types and the cluster they sit in: what the planner prices compute, memory and links with.

Peak FLOP/s are vendor datasheet figures for dense tensor-core math (no sparsity). GEMM efficiency is
the fraction of that peak the largest matrix products sustain (trainer.plan.kernel_time prices smaller
ones below it from their shapes); attention efficiency the fraction flash attention's causal FLOPs reach, for
today's kernels and for FlashAttention-2's. On an H100 SXM at head dimension 128, causal, 8k tokens,
FlashAttention-2 runs 333 TFLOP/s forward and 318 backward, cuDNN's fused attention 529 and 518 (Shah et al. 2024,
"FlashAttention-3", arXiv 2407.08608, Figures 5 and 6); PyTorch's SDPA measured 329 TFLOP/s on an H100 in
December 2024 (pytorch/pytorch#142132): 0.33 of the bf16 peak.
H100 and H200 figures are measured (benchmarks/gpu/measured: an H200, 2026-11-26, bf16 products 0.69
of the bf16 peak, fp8 products with per-tensor scales 0.62 of the fp8 peak; the H100 SXM has the same
multiprocessors, clocks and power limit); the others are calibrated on published runs
(benchmarks/planner_accuracy.py) or, where none exist, carried over from the H100 and marked so. Link figures
are per GPU and per direction: NVLink inside a node, the GPU's share of the network between nodes.
Memory is what the driver exposes, nvidia-smi's memory.total as these GPUs report it: all of the
A100's 40 or 80 GiB; 81,559 MiB of an H100's 80 GiB (79.6 GiB); 143,771 MiB of an H200 (140.4 GiB,
sold as 141 GB); 183,359 MiB of a B200 (179.1 GiB, sold as 180 GB). What a process can give its
tensors is less again: trainer.plan.memory reserves the CUDA context and NCCL's buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trainer.config import ConfigError, field_errors

GIB = 2**30
MIB = 2**20
GB = 10**9


@dataclass(frozen=True)
class GpuType:
    name: str
    peak_bf16_flops: float
    peak_fp8_flops: float | None
    peak_fp32_flops: float
    """Without tensor cores: PyTorch leaves TF32 off for matrix products, so fp32 runs at this rate."""
    memory_bytes: int
    """HBM the driver exposes (nvidia-smi's memory.total)."""
    memory_bandwidth: float
    """HBM bytes per second."""
    compute_efficiency: float
    """Fraction of peak the largest matrix products sustain."""
    fp8_efficiency: float | None
    """The same for fp8 products (per-tensor scales), of the fp8 peak; None without fp8 tensor cores."""
    attention_efficiency: float
    """Fraction of the bf16 peak flash attention's causal FLOPs reach (today's PyTorch SDPA, cuDNN's fused attention
    under Transformer Engine)."""
    flash2_efficiency: float
    """The same for FlashAttention-2's kernels, which PyTorch's SDPA ran on Hopper through 2025 (cuDNN attention
    opt-in: pytorch/pytorch#138649); on Ampere FlashAttention-2 is the fast kernel, so the two agree."""
    multiprocessors: int
    """Streaming multiprocessors: a product's tiles run in waves of this many."""
    intra_node_bandwidth: float
    """Bytes per second per GPU per direction over NVLink (or PCIe)."""
    inter_node_bandwidth: float
    """Bytes per second per GPU per direction over the network."""


# The H100 NVL's and the H100 SXM's power limits: the same 132 multiprocessors, clocked for 400 W and for 700 W.
NVL_WATTS, SXM_WATTS = 400, 700


def by_power_limit(watts: float, at_nvl_watts: float, at_sxm_watts: float) -> float:
    """A datasheet figure of an H100 held to `watts`, linear between the NVL's and the SXM's."""
    return at_nvl_watts + (at_sxm_watts - at_nvl_watts) * (watts - NVL_WATTS) / (SXM_WATTS - NVL_WATTS)


GPU_TYPES: dict[str, GpuType] = {
    gpu.name: gpu
    for gpu in (
        # Fitted on Narayanan et al. 2021, Table 1 (benchmarks/published_runs.py, the calibration set): Megatron-LM
        # of 2021 on A100s. The ceiling also absorbs that software's unfused kernels beside the products, so a
        # newer stack on an A100 will run faster than this prices. Attention: not measured, the H100's less.
        GpuType("A100-40GB", 312e12, None, 19.5e12, 40 * GIB, 1.555e12, 0.46, None, 0.50, 0.50, 108, 300 * GB, 25 * GB),
        GpuType("A100-80GB", 312e12, None, 19.5e12, 80 * GIB, 2.039e12, 0.46, None, 0.50, 0.50, 108, 300 * GB, 25 * GB),
        GpuType(
            "H100-SXM", 989e12, 1979e12, 67e12, 81_559 * MIB, 3.35e12, 0.69, 0.62, 0.55, 0.33, 132, 450 * GB, 50 * GB
        ),
        # The H100 with 96 GB of HBM2e at 2.4 TB/s that torchtitan's published runs had, on a 500 W power limit. Its
        # authors put its peak "between SXM and NVL" and do not know it; priced here by the power limit, linear between
        # the two datasheets (an assumption, not a measurement). What its driver exposes is not known: 96 GB as sold.
        GpuType(
            "H100-HBM2e",
            *(by_power_limit(500, nvl, sxm) for nvl, sxm in ((835e12, 989e12), (1670e12, 1979e12), (60e12, 67e12))),
            96 * GB,
            2.4e12,
            0.69,
            0.62,
            0.55,
            0.33,
            132,
            450 * GB,
            50 * GB,
        ),
        # Not measured: the SXM's figures, on the PCIe card's own peak and 114 multiprocessors.
        GpuType(
            "H100-PCIe", 756e12, 1513e12, 51e12, 81_559 * MIB, 2.0e12, 0.69, 0.62, 0.55, 0.33, 114, 64 * GB, 50 * GB
        ),
        GpuType("H200", 989e12, 1979e12, 67e12, 143_771 * MIB, 4.8e12, 0.69, 0.62, 0.55, 0.33, 132, 450 * GB, 50 * GB),
        # Not measured: the H100's figures, on the B200's own peak and 148 multiprocessors.
        GpuType(
            "B200", 2250e12, 4500e12, 80e12, 183_359 * MIB, 8.0e12, 0.69, 0.62, 0.55, 0.33, 148, 900 * GB, 100 * GB
        ),
    )
}

# NCCL's ring collectives reach about this fraction of the link's bandwidth for large buffers.
LINK_EFFICIENCY = 0.8
INTRA_NODE_LATENCY_S = 5e-6
INTER_NODE_LATENCY_S = 15e-6


class ClusterSpec(BaseModel):
    """Where a run would go: how many nodes of which GPU, and how they are linked."""

    model_config = ConfigDict(extra="forbid")

    gpu: str = Field("H100-SXM", description=f"GPU type, one of {', '.join(GPU_TYPES)}.")
    nodes: int = Field(1, ge=1, le=100_000, description="Nodes in the cluster.")
    gpus_per_node: int = Field(8, ge=1, le=72, description="GPUs in each node (one NVLink domain).")
    intra_node_bandwidth: float | None = Field(
        None, gt=0, description="Bytes/s per GPU per direction inside a node; null: the GPU type's NVLink figure."
    )
    inter_node_bandwidth: float | None = Field(
        None, gt=0, description="Bytes/s per GPU per direction between nodes; null: the GPU type's network share."
    )
    intra_node_latency_s: float = Field(INTRA_NODE_LATENCY_S, ge=0, description="Per-message latency inside a node.")
    inter_node_latency_s: float = Field(INTER_NODE_LATENCY_S, ge=0, description="Per-message latency between nodes.")
    compute_efficiency: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Fraction of peak FLOP/s the largest matrix products reach; null: the GPU type's figure.",
    )

    @model_validator(mode="after")
    def _known_gpu(self) -> ClusterSpec:
        if self.gpu not in GPU_TYPES:
            raise ValueError(f"gpu: unknown GPU type {self.gpu!r}; valid choices are {list(GPU_TYPES)}")
        return self

    @property
    def gpu_type(self) -> GpuType:
        return GPU_TYPES[self.gpu]

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def intra_bandwidth(self) -> float:
        return self.intra_node_bandwidth or self.gpu_type.intra_node_bandwidth

    @property
    def inter_bandwidth(self) -> float:
        return self.inter_node_bandwidth or self.gpu_type.inter_node_bandwidth

    @property
    def efficiency(self) -> float:
        return self.compute_efficiency or self.gpu_type.compute_efficiency


def parse_cluster(document: object) -> ClusterSpec:
    """Validate a cluster description, raising ConfigError keyed by "cluster.<field>"."""
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise ConfigError({"cluster": "must be a JSON object"})
    try:
        return ClusterSpec.model_validate(document)
    except ValidationError as error:
        errors = {}
        for field, message in field_errors(error).items():
            if field == "config" and message.startswith("gpu: "):
                field, message = "gpu", message.removeprefix("gpu: ")
            errors[f"cluster.{field}"] = message
        raise ConfigError(errors) from None
