"""The planner's estimates against closed forms from the literature and against its own parts."""

import dataclasses
import subprocess
import sys

import pytest

from trainer.config import ConfigError, parse_config
from trainer.plan.activations import Shape, layer_bytes, megatron_layer
from trainer.plan.estimate import estimate, parse_plan
from trainer.plan.hardware import GPU_TYPES, by_power_limit
from trainer.plan.layout import Layout
from trainer.plan.memory import (
    activation_terms,
    buffer_terms,
    in_flight_microbatches,
    layer_activation_bytes,
    model_state_terms,
    rank_state_elements,
    state_elements,
)
from trainer.plan.parameters import rank_tensors, total_parameters
from trainer.plan.passes import block_pass_bytes
from trainer.plan.schedule import simulate
from trainer.plan.terms import total
from trainer.plan.traffic import predicted_matrix

# Every matrix's rows divide by 4 and 8, so ZeRO's shards come out even.
SMALL_MODEL = {"layers": 4, "dim": 256, "heads": 8, "kv_heads": 4, "ffn": 512, "vocab": 512, "seq_len": 256}


def plan(parallel: dict, precision: str = "bf16", model: dict = SMALL_MODEL, **sections) -> Layout:
    document = {"model": model, "parallel": parallel, "compute": {"precision": precision}, **sections}
    return Layout(parse_config(document, runnable=False))


def model_state_bytes(layout: Layout) -> float:
    """Parameters + gradients + optimizer states of pipeline rank 0, without AdamW's step counts."""
    tensors = rank_tensors(layout.model, layout.parallel, 0)
    return total(model_state_terms(layout, state_elements(layout, tensors))) - 4 * len(tensors)


@pytest.mark.parametrize(
    ("parallel", "bytes_per_parameter"),
    [
        ({"dp_replicate": 4}, 16),
        ({"dp_shard": 4, "zero_stage": 1}, 4 + 12 / 4),
        ({"dp_shard": 4, "zero_stage": 2}, 2 + 14 / 4),
        ({"dp_shard": 4, "zero_stage": 3}, 16 / 4),
        ({"dp_shard": 8}, 16 / 8),
        ({"dp_replicate": 2, "dp_shard": 4}, 16 / 4),
    ],
)
def test_model_states_follow_zero(parallel, bytes_per_parameter):
    """ZeRO (Rajbhandari et al. 2020, mixed precision, K = 12): 16Φ, 4Φ + 12Φ/N, 2Φ + 14Φ/N, 16Φ/N, as Megatron-LM
    (its distributed optimizer, its FSDP) holds them."""
    layout = dataclasses.replace(plan(parallel), runtime="megatron")
    assert model_state_bytes(layout) == bytes_per_parameter * total_parameters(layout.model)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_loom_keeps_every_zero_stage_sharded_between_steps(zero_stage):
    """loom's trainer runs ZeRO-1 and 2 on FSDP2: between steps its fp32 parameters, gradients and AdamW moments
    are sharded like ZeRO-3's; within a step the whole parameters it gathers are a buffer of their own."""
    layout = plan({"dp_shard": 4, "zero_stage": zero_stage, "reshard_after_forward": True})
    assert model_state_bytes(layout) == 16 / 4 * total_parameters(layout.model)
    buffers = {term.name: term.value for term in buffer_terms(layout, 0, rank_state_elements(layout, 0))}
    # ZeRO-3 frees each block after its forward (two held at a time); ZeRO-1 and 2 hold every block whole.
    blocks_held = 2 if zero_stage == 3 else SMALL_MODEL["layers"]
    bf16_model = 2 * total_parameters(layout.model)
    assert buffers["FSDP gathered parameters"] == bf16_model * blocks_held / SMALL_MODEL["layers"]


def test_tensor_parallel_splits_matrices_but_not_norms():
    whole, split = plan({}), plan({"tp": 4})
    norms = 2 * SMALL_MODEL["layers"] + 1
    norm_elements = norms * SMALL_MODEL["dim"]
    matrices = total_parameters(whole.model) - norm_elements
    # DTensor leaves the vocab-parallel embedding's gradient whole on every tp rank (no FSDP here).
    embedding_gradient_rest = 4 * SMALL_MODEL["vocab"] * SMALL_MODEL["dim"] * 3 / 4
    assert model_state_bytes(split) == 16 * (matrices / 4 + norm_elements) + embedding_gradient_rest


S, B, H, A = 2048, 1, 12288, 96
SBH = S * B * H


@pytest.mark.parametrize(
    ("tp", "sequence_parallel", "recompute", "expected"),
    [
        (1, False, "none", 34 * SBH + 5 * A * S * S * B),
        (8, False, "none", SBH * (10 + 24 / 8 + 5 * A * S / (H * 8))),
        (8, True, "none", SBH / 8 * (34 + 5 * A * S / H)),
        (8, False, "selective", SBH * (10 + 24 / 8)),
        (8, True, "selective", SBH / 8 * 34),
        (8, True, "full", 2 * SBH / 8),
        (1, False, "full", 2 * SBH),
    ],
)
def test_megatron_layer_reproduces_korthikanti(tp, sequence_parallel, recompute, expected):
    """Korthikanti et al. 2022, table 2: activation bytes per layer for GPT-3 175B's shape."""
    layer = megatron_layer(Shape(s=S, b=B, h=H, a=A, kv=H, f=4 * H))
    assert layer_bytes(layer, recompute, tp, sequence_parallel) == pytest.approx(expected, rel=1e-12)


def test_recompute_and_sequence_parallel_shrink_loom_activations():
    def activations(**changes) -> float:
        parallel = {"tp": 4, **changes.pop("parallel", {})}
        layout = plan(parallel, compute={"precision": "bf16", **changes})
        return activation_terms(layout, 0)[0].value

    none, selective, full = (activations(recompute=mode) for mode in ("none", "selective", "full"))
    assert none > selective > full
    assert activations(parallel={"sequence_parallel": False}) > none


PARALLEL_BLOCKS = SMALL_MODEL | {"parallel_blocks": True}


def test_a_parallel_block_holds_and_runs_one_norm():
    sequential, parallel = plan({"tp": 4}), plan({"tp": 4}, model=PARALLEL_BLOCKS)
    assert (
        total_parameters(parallel.model)
        == total_parameters(sequential.model) - SMALL_MODEL["layers"] * SMALL_MODEL["dim"]
    )
    assert not any("mlp_norm" in tensor.name for tensor in rank_tensors(parallel.model, parallel.parallel, 0))
    before, after = block_pass_bytes(sequential), block_pass_bytes(parallel)
    # A fused norm reads and writes the rank's sequence-parallel share of the hidden state, 2 bf16 bytes each.
    assert (after.attention, after.residual) == (before.attention, before.residual)
    assert after.mlp == before.mlp - SMALL_MODEL["dim"] / 4 * 2 * 2


@pytest.mark.parametrize(
    ("parallel", "precision", "recompute", "fewer_bytes_per_token"),
    [
        # The MLP's norm input and statistics, and its own input: the attention norm's output, kept for both.
        ({}, "fp32", "none", 4 * SMALL_MODEL["dim"] + 4 + 4 * SMALL_MODEL["dim"]),
        ({}, "fp32", "selective", 4 * SMALL_MODEL["dim"] + 4 + 4 * SMALL_MODEL["dim"]),
        ({}, "fp32", "full", 0),
        # Autocast casts the norm's output for every linear layer: the MLP's norm input (the fp32 stream) and
        # statistics are what goes.
        ({}, "bf16", "none", 4 * SMALL_MODEL["dim"] + 4),
        # Sequence parallelism gathers the norm's output for the MLP, a copy: the norm's share goes, split over tp.
        ({"tp": 4}, "fp32", "selective", (4 * SMALL_MODEL["dim"] + 4) / 4),
    ],
)
def test_a_parallel_block_keeps_one_norms_tensors_and_its_output_once(
    parallel, precision, recompute, fewer_bytes_per_token
):
    def layer(model: dict) -> float:
        layout = plan(parallel, precision, model, compute={"precision": precision, "recompute": recompute})
        return layer_activation_bytes(layout)

    tokens = SMALL_MODEL["seq_len"] * plan({}).micro_seqs
    assert layer(PARALLEL_BLOCKS) == layer(SMALL_MODEL) - tokens * fewer_bytes_per_token


def test_the_activation_formula_shows_one_norms_statistics_in_a_parallel_block():
    formulas = [
        activation_terms(plan({}, "fp32", model, compute={"precision": "fp32"}), 0)[0].formula
        for model in (SMALL_MODEL, PARALLEL_BLOCKS)
    ]
    assert "2sb·4B" in formulas[0] and "2sb" not in formulas[1] and " sb·4B" in formulas[1]


@pytest.mark.parametrize(
    ("schedule", "stages_per_rank"),
    [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("LoopedBFS", 2), ("InterleavedZeroBubble", 2),
     ("ZBVZeroBubble", 2), ("DualPipeV", 2)],
)  # fmt: skip
def test_in_flight_microbatches_match_the_simulated_schedule(schedule, stages_per_rank):
    p, m = 4, 8
    layout = plan(
        {"pp": p, "pp_schedule": schedule, "stages_per_rank": stages_per_rank, "microbatches": m},
        model={**SMALL_MODEL, "layers": 8},
        data={"micro_batch": m},
    )
    timeline = simulate(schedule, p, m, stages_per_rank, 1.0, 1.0, 1.0)
    for rank in range(p):
        assert in_flight_microbatches(layout, rank) == timeline.peak_in_flight[rank] / stages_per_rank, rank


def data_parallel_sent(parallel: dict) -> float:
    result = estimate({"model": SMALL_MODEL, "parallel": parallel, "compute": {"precision": "fp32"}},
                      {"nodes": 1, "gpus_per_node": 8})  # fmt: skip
    return result.comm_by_kind()["dp"]["sent_bytes"]


def test_zero3_moves_one_and_a_half_times_what_ddp_moves():
    """Rajbhandari et al.: ZeRO-3 costs 3Φ per step against data parallelism's 2Φ (same dtype)."""
    ddp = data_parallel_sent({"dp_replicate": 8})
    fsdp = data_parallel_sent({"dp_shard": 8})
    parameters = total_parameters(plan({}).model)
    assert ddp == pytest.approx(2 * 7 / 8 * 4 * parameters)
    assert fsdp == pytest.approx(1.5 * ddp)


def test_step_time_is_the_sum_of_its_terms_and_throughput_follows():
    result = estimate({"model": {"preset": "llama3-8b"}, "parallel": {"dp_shard": 8, "tp": 1},
                       "data": {"micro_batch": 1}, "compute": {"precision": "bf16", "recompute": "full"}},
                      {"gpu": "H100-SXM", "nodes": 1})  # fmt: skip
    assert result.step_s == pytest.approx(sum(term["value"] for term in result.to_json()["time"]["terms"]))
    assert result.tokens_per_s == pytest.approx(8 * 8192 / result.step_s)
    assert 0 < result.mfu < result.cluster.efficiency
    # Full recompute repeats every block's forward (a third of the model's FLOPs), not the output projection's.
    model = result.layout.model
    output_forward = 2 * model.vocab * model.dim * 8 * 8192
    repeated = result.model_flops_per_step / 3 - output_forward
    assert result.hardware_flops_per_step == pytest.approx(result.model_flops_per_step + repeated, rel=1e-3)


def test_llama3_70b_does_not_fit_on_fsdp_alone_and_says_why():
    result = estimate({"model": {"preset": "llama3-70b"}, "parallel": {"dp_shard": 64},
                       "data": {"micro_batch": 1}, "compute": {"precision": "bf16"}},
                      {"gpu": "H100-SXM", "nodes": 8})  # fmt: skip
    assert not result.fits
    (warning,) = [w for w in result.warnings if w["field"] == "memory"]
    assert "activations" in warning["message"]


def test_tensor_parallel_across_nodes_is_warned():
    result = estimate({"model": SMALL_MODEL, "parallel": {"tp": 4}}, {"nodes": 2, "gpus_per_node": 2})
    assert "parallel.tp" in {w["field"] for w in result.warnings}


@pytest.mark.parametrize(
    ("document", "cluster", "field"),
    [
        ({"model": {"preset": "llama3-9000b"}}, {}, "model.preset"),
        ({"model": SMALL_MODEL, "parallel": {"dp_shard": 16}}, {"nodes": 1}, "cluster.nodes"),
        ({"model": SMALL_MODEL, "compute": {"precision": "fp8"}}, {"gpu": "A100-80GB"}, "compute.precision"),
        ({"model": SMALL_MODEL}, {"gpu": "TPU"}, "cluster.gpu"),
        ({"model": SMALL_MODEL, "parallel": {"tp": 3}}, {}, "parallel.tp"),
        ({"model": SMALL_MODEL, "parallel": {"ep": 2}}, {}, "parallel.ep"),
        ({"model": SMALL_MODEL, "parallel": {"zero_stage": 2}}, {}, "parallel.zero_stage"),
    ],
)
def test_invalid_plans_name_the_field(document, cluster, field):
    with pytest.raises(ConfigError) as refused:
        parse_plan(document, cluster)
    assert field in refused.value.errors


def test_the_planner_estimates_what_the_trainer_refuses_to_run():
    mixtral = {"model": {"preset": "mixtral-8x7b"}, "parallel": {"dp_shard": 8, "ep": 8}}
    assert estimate(mixtral, {"nodes": 1}).layout.model.experts == 8
    # Expert parallelism across replicas rather than within the ranks that shard the model.
    document = {"model": {"experts": 8, "top_k": 2}, "parallel": {"dp_replicate": 2, "ep": 2}}
    assert estimate(document, {"nodes": 1}).layout.parallel.ep == 2
    with pytest.raises(ConfigError) as refused:
        parse_config(document)
    assert "parallel.ep" in refused.value.errors


def test_predicted_traffic_has_the_layout_structure():
    """pp2 × dp2 × tp2: TP pairs heaviest, then DP pairs, PP pairs only between adjacent stages."""
    config = parse_config({"model": {"layers": 4, "dim": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "seq_len": 64},
                           "parallel": {"pp": 2, "dp_shard": 2, "tp": 2, "microbatches": 2},
                           "compute": {"precision": "fp32"}, "data": {"micro_batch": 4}})  # fmt: skip
    matrix = predicted_matrix(config)
    tp, dp, pp = (matrix.by_kind[kind] for kind in ("tp", "dp", "pp"))
    for rank in range(8):
        # Ranks are placed tp innermost, then dp, then pp: the partners differ in one bit each.
        assert tp[rank][rank ^ 1] > dp[rank][rank ^ 2] > pp[rank][rank ^ 4] > 0
        assert sum(map(bool, matrix.bytes[rank])) == 3


def test_the_planner_loads_without_torch():
    probe = "import sys; import trainer.plan.estimate, trainer.plan.schedule; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", probe], check=True)


# ---- what a GPU can give its tensors ----

GIB = 2**30
MIB = 2**20


def test_a_layout_peaking_just_under_the_hbm_does_not_fit():
    """Llama 3 8B cut to 27 layers, no recompute, 2 × 8,320 tokens a rank: the allocator peaks at 79.2
    GiB, under the H100's 80 GiB and the 79.6 GiB its driver exposes, but the CUDA context and NCCL's
    buffers need their share too."""
    document = {
        "model": {"preset": "llama3-8b", "layers": 27, "seq_len": 8320},
        "parallel": {"dp_shard": 8},
        "compute": {"precision": "bf16", "recompute": "none"},
        "data": {"micro_batch": 2},
    }
    result = estimate(document, {"gpu": "H100-SXM"}, timeline=False)
    memory = result.to_json(timeline=False)["memory"]
    assert memory["capacity_bytes"] == 81_559 * MIB
    assert 79.1 * GIB < memory["peak_bytes"] < memory["capacity_bytes"] < 80 * GIB
    assert memory["usable_bytes"] < memory["peak_bytes"]
    assert memory["headroom_bytes"] == memory["usable_bytes"] - memory["peak_bytes"] < 0
    assert memory["fits"] is False
    assert any(w["field"] == "memory" and "GiB usable" in w["message"] for w in result.warnings)


def test_usable_memory_is_the_gpu_less_the_cuda_context_and_nccls_buffers_per_communicator():
    document = {
        "model": {"preset": "llama3-8b"},
        "parallel": {"dp_shard": 8},
        "compute": {"recompute": "selective"},
        "data": {"micro_batch": 1},
    }
    fsdp = estimate(document, {}, timeline=False)
    memory = fsdp.to_json(timeline=False)["memory"]
    outside = {term["name"]: term["value"] for term in memory["outside_allocator"]}
    # 16 channels × 2 peers × (Simple 4 MiB + LL128 4,915,200 B + LL 512 KiB): one FSDP communicator.
    assert outside == {"CUDA context": 0.75 * GIB, "NCCL buffers": 16 * 2 * (4 * MIB + 4_915_200 + 512 * 1024)}
    assert memory["usable_bytes"] == memory["capacity_bytes"] - sum(outside.values())
    assert memory["headroom_bytes"] == pytest.approx(memory["usable_bytes"] - memory["peak_bytes"])
    assert memory["headroom_bytes"] > 0 and memory["fits"]

    # tp, cp, the FSDP group over dp_shard × cp, and two pipeline neighbours: five communicators.
    layered = {"tp": 2, "cp": 2, "dp_shard": 2, "pp": 4, "microbatches": 4}
    wide = estimate(
        {"model": {"preset": "llama3-8b"}, "parallel": layered, "data": {"micro_batch": 4}},
        {"nodes": 4},
        timeline=False,
    )
    nccl = next(term for term in wide.outside_allocator if term.name == "NCCL buffers")
    assert nccl.value == 5 * outside["NCCL buffers"]
    assert wide.usable_bytes == memory["capacity_bytes"] - 0.75 * GIB - nccl.value


def test_one_replica_holds_only_the_gradients_backward_has_made_at_its_peak():
    def terms_of(parallel, micro_batch):
        document = {"model": SMALL_MODEL, "parallel": parallel, "data": {"micro_batch": micro_batch}}
        cluster = {"gpu": "H100-SXM", "nodes": 1, "gpus_per_node": 2}
        return {term.name: term.value for term in estimate(document, cluster, timeline=False).peak.terms}

    replicated = terms_of({"dp_replicate": 2}, 8)
    for micro_batch in (8, 1):
        alone = terms_of({}, micro_batch)
        every_gradient = replicated["gradients"]
        # Backward frees the activations, the loss's buffers and autocast's weight copies as it goes.
        freed = sum(
            alone.get(name, 0) for name in ("activations", "logits and cross-entropy", "bf16 weight copies (autocast)")
        )
        output = 4 * (SMALL_MODEL["vocab"] * SMALL_MODEL["dim"] + SMALL_MODEL["dim"])
        assert alone["gradients"] == max(min(output, every_gradient), every_gradient - freed)
    # DDP's buckets and their reduction keep every gradient.
    assert replicated["gradients"] == 4 * total_parameters(parse_config({"model": SMALL_MODEL}, runnable=False).model)


def test_a_power_limited_h100_is_priced_between_the_nvl_and_the_sxm_by_its_limit():
    """torchtitan's H100s at 500 W: a third of the way from the NVL's 400 W datasheet to the SXM's 700 W one. Every
    kernel of a step on it takes longer than on an SXM by the ratio of the peaks (bound by compute) or of the memory
    bandwidths (2.4 TB/s of HBM2e against 3.35: bound by memory), so the step by a ratio between the two."""
    limited, sxm = GPU_TYPES["H100-HBM2e"], GPU_TYPES["H100-SXM"]
    assert limited.peak_bf16_flops == pytest.approx(835e12 + (989e12 - 835e12) / 3)
    assert limited.peak_fp8_flops == pytest.approx(1670e12 + (1979e12 - 1670e12) / 3)
    assert by_power_limit(400, 1.0, 2.0) == 1.0 and by_power_limit(700, 1.0, 2.0) == 2.0
    document = {"model": {"preset": "llama3-8b"}, "parallel": {"dp_shard": 8}, "data": {"micro_batch": 2}}
    slower = estimate(document, {"gpu": "H100-HBM2e"}, timeline=False).step_s
    faster = estimate(document, {"gpu": "H100-SXM"}, timeline=False).step_s
    peaks = sxm.peak_bf16_flops / limited.peak_bf16_flops
    assert peaks < slower / faster < sxm.memory_bandwidth / limited.memory_bandwidth
