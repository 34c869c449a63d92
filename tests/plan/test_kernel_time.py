"""The compute model's pieces against their closed forms: a product's roofline with wave quantization, what
each runtime recomputes, which products run in fp8, unfused attention's score-matrix passes, and where sequence
parallelism splits the memory-bound work."""

import pytest

from trainer.config import parse_config
from trainer.plan.compute import UNFUSED_SCORE_BYTES_FORWARD, stages_compute
from trainer.plan.estimate import estimate
from trainer.plan.hardware import GPU_TYPES, parse_cluster
from trainer.plan.kernel_time import (
    KERNEL_FLOOR_S,
    REDUCTION_HALF_K,
    TILE_M,
    TILE_N,
    gemm_seconds,
    memory_seconds,
)
from trainer.plan.layout import Layout

H100 = GPU_TYPES["H100-SXM"]
PEAK, CEILING = H100.peak_bf16_flops, H100.compute_efficiency
MODEL = {"layers": 4, "dim": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 128256, "seq_len": 4096}


def compute(parallel=None, precision="bf16", recompute="none", runtime="loom", attention="flash"):
    document = {
        "model": MODEL,
        "parallel": parallel or {},
        "compute": {"precision": precision, "recompute": recompute},
        "data": {"micro_batch": 2},
    }
    config = parse_config(document, runnable=False)
    cluster = parse_cluster({"gpu": "H100-SXM", "nodes": 1, "gpus_per_node": 8})
    return stages_compute(Layout(config, runtime, attention), cluster, [0])


def test_a_product_one_tile_past_a_full_wave_pays_for_a_second_wave():
    # 12 × 11 tiles fill the H100's 132 multiprocessors once; one more row of m adds a 13th row of tiles.
    k, m, n = 8192, 12 * TILE_M, 11 * TILE_N
    assert 12 * 11 == H100.multiprocessors
    first = gemm_seconds(m, k, n, H100, PEAK, CEILING, 2) - KERNEL_FLOOR_S
    second = gemm_seconds(m + 1, k, n, H100, PEAK, CEILING, 2) - KERNEL_FLOOR_S
    assert first == pytest.approx(2 * m * k * n / (PEAK * CEILING * k / (k + REDUCTION_HALF_K)))
    assert second / first == pytest.approx((m + 1) / m * (2 * 132) / (13 * 11))


def test_a_short_reduction_halves_the_rate_at_its_half_point():
    m = n = 16 * 1024
    long_k, short_k = 65536, REDUCTION_HALF_K
    per_flop_long = (gemm_seconds(m, long_k, n, H100, PEAK, CEILING, 2) - KERNEL_FLOOR_S) / long_k
    per_flop_short = (gemm_seconds(m, short_k, n, H100, PEAK, CEILING, 2) - KERNEL_FLOOR_S) / short_k
    # Memory would bound a k of 64 at these m and n were it not for the reduction's own penalty; check the bound.
    memory = memory_seconds((m * short_k + short_k * n + m * n) * 2, H100)
    assert per_flop_short * short_k == pytest.approx(max(memory, 2 * per_flop_long * short_k * (1 + 64 / 65536)))


def test_fp32_products_run_without_tensor_cores():
    bf16, fp32 = compute(precision="bf16"), compute(precision="fp32")
    ratio = fp32.weight_gradients.gemm_s / bf16.weight_gradients.gemm_s
    assert ratio == pytest.approx(H100.peak_bf16_flops / H100.peak_fp32_flops, rel=0.05)


def test_fp8_speeds_up_only_the_blocks_linear_layers():
    bf16, fp8 = compute(precision="bf16"), compute(precision="fp8")
    assert fp8.forward.attention_s == bf16.forward.attention_s
    assert fp8.forward.memory_s == bf16.forward.memory_s
    assert bf16.forward.gemm_s / 2 < fp8.forward.gemm_s < bf16.forward.gemm_s


def test_megatron_selective_recompute_repeats_only_the_attention_core():
    megatron = compute(recompute="selective", runtime="megatron")
    loom = compute(recompute="selective", runtime="loom")
    assert megatron.recompute.gemm_s == 0 and megatron.recompute.memory_s == 0
    assert megatron.recompute.attention_s == megatron.forward.attention_s
    assert loom.recompute.gemm_s > 0 and loom.recompute.attention_s == loom.forward.attention_s
    tokens = 2 * MODEL["seq_len"]
    assert megatron.recompute_flops == 4 * tokens * MODEL["layers"] * MODEL["dim"] * MODEL["seq_len"]
    assert loom.recompute_flops > megatron.recompute_flops


def test_looms_selective_recompute_reruns_the_attention_modules_passes_but_not_its_norm():
    """The trainer checkpoints the attention module alone; its norm runs outside (trainer/parallel/recompute.py)."""
    loom = compute(recompute="selective")
    dim, heads, kv_heads = MODEL["dim"], MODEL["heads"], MODEL["kv_heads"]
    # Fused rotary reads and writes q and k once, 2 bf16 bytes each, per token of every layer.
    rotary = 2 * MODEL["seq_len"] * MODEL["layers"] * 2 * 2 * (heads + kv_heads) * dim // heads
    assert loom.recompute.memory_s == pytest.approx(memory_seconds(rotary, H100))


def test_unfused_attention_moves_the_whole_score_matrix():
    flash, unfused = compute(attention="flash"), compute(attention="unfused")
    assert unfused.forward.attention_s == 0 and flash.forward.attention_s > 0
    seq, heads = MODEL["seq_len"], 2 * MODEL["heads"]
    scores = memory_seconds(MODEL["layers"] * heads * seq * seq * UNFUSED_SCORE_BYTES_FORWARD, H100)
    assert unfused.forward.memory_s - flash.forward.memory_s == pytest.approx(scores)


def test_sequence_parallel_splits_the_norms_and_residuals_over_the_tp_ranks():
    plain = compute(parallel={"tp": 8, "dp_shard": 1, "sequence_parallel": False})
    split = compute(parallel={"tp": 8, "dp_shard": 1, "sequence_parallel": True})
    assert split.forward.memory_s < plain.forward.memory_s
    assert split.forward.gemm_s == plain.forward.gemm_s


def tp_traffic(runtime):
    document = {
        "model": MODEL,
        "parallel": {"tp": 8, "dp_shard": 1, "sequence_parallel": True},
        "data": {"micro_batch": 2},
    }
    result = estimate(document, {"gpu": "H100-SXM", "nodes": 1, "gpus_per_node": 8}, runtime=runtime)
    rank = result.ranks[0]
    return rank, [item for item in rank.traffic if item.kind == "tp"]


def test_megatron_hides_the_backward_tp_collectives_under_the_weight_gradients():
    loom_rank, loom = tp_traffic("loom")
    megatron_rank, megatron = tp_traffic("megatron")
    assert all(item.exposed_s == item.time_s for item in loom)
    assert sum(item.calls for item in loom) == sum(item.calls for item in megatron)
    overlapped = [item for item in megatron if item.overlaps_weight_gradients]
    # Two of each block's four collectives run in backward.
    assert sum(item.calls for item in overlapped) == 2 * 2 * MODEL["layers"]
    hidden = sum(item.time_s - item.exposed_s for item in overlapped)
    assert hidden == pytest.approx(
        min(sum(item.time_s for item in overlapped), megatron_rank.compute.weight_gradient_s)
    )
    exposed = sum(item.exposed_s for item in megatron if not item.overlaps_weight_gradients)
    assert exposed == pytest.approx(sum(item.time_s for item in megatron if not item.overlaps_weight_gradients))
