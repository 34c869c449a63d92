"""How long one kernel takes on a GPU: the planner prices a step as the sum of its kernels.

Matrix products follow a roofline with the GPU's wave quantization. The output is cut into 128 × 128 tiles, one
per multiprocessor at a time, so a product whose tiles fill 1.1 waves pays for 2. A short reduction dimension k
keeps the tensor cores' pipeline from filling: efficiency k/(k + 64). The ceiling is the GPU type's GEMM efficiency
(the fraction of the datasheet peak its largest products sustain), and memory traffic bounds what compute does not.
Every kernel costs at least a fixed 2 µs (launch, ramp and tail). Fitted on 2,304 bf16 products measured on an H200
(benchmarks/gpu/measured/h200-2026-11-26-gemm.json): 2.1 % error in time summed over all of them, 2.8 % mean
error per block for hidden sizes from 4096 up.

Attention runs as a fused flash kernel: causal, it does half the FLOPs of the full score matrix, at the GPU type's
attention efficiency (fitted on causal SDPA forward+backward on the same H200: the marginal rate of the large
shapes), or FlashAttention-2's (trainer.plan.hardware). Norms, residual additions, activations, rotary embeddings
and the loss's logits are memory-bound (trainer.plan.passes): bytes over the HBM bandwidth a streaming copy reaches.
"""

from __future__ import annotations

import math

from trainer.plan.hardware import GpuType

TILE_M, TILE_N = 128, 128
REDUCTION_HALF_K = 64
"""The k at which a product reaches half its ceiling from the reduction's length alone."""
KERNEL_FLOOR_S = 2e-6
STREAM_EFFICIENCY = 0.89
"""A device-to-device copy's bytes read + written per second over the datasheet HBM bandwidth (H200: 4.28 of
4.8 TB/s, measured 2026-11-26)."""


def wave_efficiency(m: int, n: int, multiprocessors: int) -> float:
    """The share of the last wave's multiprocessors that get a tile, averaged over every wave."""
    tiles = math.ceil(m / TILE_M) * math.ceil(n / TILE_N)
    waves = math.ceil(tiles / multiprocessors)
    return tiles / (waves * multiprocessors)


def gemm_seconds(m: float, k: float, n: float, gpu: GpuType, peak: float, ceiling: float, element_bytes: int) -> float:
    """One [m, k] × [k, n] product at `peak` FLOP/s (the precision's) with `ceiling` the large-product efficiency."""
    if m <= 0 or k <= 0 or n <= 0:
        return 0.0
    m, k, n = math.ceil(m), math.ceil(k), math.ceil(n)
    efficiency = ceiling * wave_efficiency(m, n, gpu.multiprocessors) * k / (k + REDUCTION_HALF_K)
    compute_s = 2.0 * m * k * n / (peak * efficiency)
    memory_s = memory_seconds((m * k + k * n + m * n) * element_bytes, gpu)
    return max(compute_s, memory_s) + KERNEL_FLOOR_S


def memory_seconds(bytes_moved: float, gpu: GpuType) -> float:
    """A memory-bound pass reading and writing `bytes_moved` in all."""
    return bytes_moved / (gpu.memory_bandwidth * STREAM_EFFICIENCY)


def attention_seconds(causal_flops: float, gpu: GpuType, flash2: bool = False) -> float:
    """Flash attention doing `causal_flops` (the causal half of the score matrix's products), in bf16; `flash2`
    prices FlashAttention-2's kernels instead of today's."""
    efficiency = gpu.flash2_efficiency if flash2 else gpu.attention_efficiency
    return causal_flops / (gpu.peak_bf16_flops * efficiency) if causal_flops > 0 else 0.0
