"""What each runtime's own code costs, against closed forms counted from that code: memory-bound passes fused or
op by op, FlashAttention-2's rate, and torchtitan's per-op selective checkpointing in time and memory."""

import pytest

from trainer.config import parse_config
from trainer.plan.compute import stages_compute
from trainer.plan.estimate import estimate
from trainer.plan.hardware import GPU_TYPES, parse_cluster
from trainer.plan.kernel_time import memory_seconds
from trainer.plan.layout import Layout
from trainer.plan.passes import block_pass_bytes

H100 = GPU_TYPES["H100-SXM"]
LAYERS, DIM, HEADS, KV_HEADS, FFN, SEQ, MICRO = 4, 4096, 32, 8, 14336, 4096, 2
HEAD_DIM, KV = DIM // HEADS, KV_HEADS * DIM // HEADS
MODEL = {"layers": LAYERS, "dim": DIM, "heads": HEADS, "kv_heads": KV_HEADS, "ffn": FFN, "vocab": 128256}
TOKENS = SEQ * MICRO
CLUSTER = {"gpu": "H100-SXM", "nodes": 1, "gpus_per_node": 8}


def document(parallel=None, recompute="none", compile=False, kernels="auto"):
    return {
        "model": {**MODEL, "seq_len": SEQ},
        "parallel": parallel or {},
        "compute": {"precision": "bf16", "recompute": recompute, "compile": compile, "kernels": kernels},
        "data": {"micro_batch": MICRO},
    }


def layout(runtime="loom", attention="flash", **kwargs):
    return Layout(parse_config(document(**kwargs), runnable=False), runtime, attention)


def compute(runtime="loom", attention="flash", **kwargs):
    return stages_compute(layout(runtime, attention, **kwargs), parse_cluster(CLUSTER), [0])


def test_fused_passes_read_and_write_each_tensor_once():
    # Norm 2·2 B per hidden element, rotary 2·2 B per q/k element, SwiGLU 3·2 B per ffn element, two residual
    # additions 3·2 B each per hidden element.
    fused = 2 * 4 * DIM + 4 * (HEADS + KV_HEADS) * HEAD_DIM + 6 * FFN + 2 * 6 * DIM
    for runtime, compiled in (("megatron", False), ("torchtitan", True), ("loom", False), ("loom", True)):
        assert block_pass_bytes(layout(runtime, compile=compiled)).block == fused, (runtime, compiled)


def test_torchtitans_eager_ops_move_what_each_op_reads_and_writes():
    passes = block_pass_bytes(layout("torchtitan"))
    norm, rotary, swiglu = 28 + 4 * 2, 16 + 2 * 2, 5 * 2
    repeat_kv = 2 * (KV + DIM) * 2
    contiguous_output = 2 * DIM * 2
    assert passes.attention == DIM * norm + (HEADS + KV_HEADS) * HEAD_DIM * rotary + repeat_kv + contiguous_output
    assert passes.mlp == DIM * norm + FFN * swiglu
    assert passes.block == 626_688


def test_looms_torch_ops_under_tensor_parallel_are_priced_op_by_op_and_split_by_sequence_parallel():
    passes = block_pass_bytes(layout(parallel={"tp": 2, "dp_shard": 1, "sequence_parallel": True}, kernels="torch"))
    norm, rotary, swiglu = 32 + 2 * 2, 48 + 2 * 2, 32 + 3 * 2
    assert passes.attention == DIM / 2 * norm + (HEADS + KV_HEADS) * HEAD_DIM / 2 * rotary
    assert passes.mlp == DIM / 2 * norm + FFN / 2 * swiglu
    assert passes.residual == 2 * 6 * DIM / 2


def test_looms_kernels_under_tensor_parallel_are_fused_on_each_ranks_share():
    passes = block_pass_bytes(layout(parallel={"tp": 2, "dp_shard": 1, "sequence_parallel": True}))
    fused_share = (2 * 4 * DIM + 4 * (HEADS + KV_HEADS) * HEAD_DIM + 6 * FFN + 2 * 6 * DIM) / 2
    assert passes.block == fused_share


def test_eager_passes_cost_their_bytes_at_the_streaming_rate():
    eager, compiled = compute("torchtitan"), compute("torchtitan", compile=True)
    extra = block_pass_bytes(layout("torchtitan")).block - block_pass_bytes(layout("torchtitan", compile=True)).block
    assert eager.forward.memory_s - compiled.forward.memory_s == pytest.approx(
        memory_seconds(LAYERS * TOKENS * extra, H100)
    )
    assert eager.forward.gemm_s == compiled.forward.gemm_s


def test_flashattention2_runs_at_its_own_share_of_the_peak():
    today, flash2 = compute(attention="flash"), compute(attention="flash2")
    assert flash2.forward.attention_s / today.forward.attention_s == pytest.approx(
        H100.attention_efficiency / H100.flash2_efficiency
    )
    causal_flops = LAYERS * 2 * TOKENS * SEQ * DIM
    assert flash2.forward.attention_s == pytest.approx(causal_flops / (H100.peak_bf16_flops * 0.33))


def test_torchtitans_per_op_checkpointing_reruns_k_the_output_projection_and_up():
    titan = compute("torchtitan", recompute="selective")
    assert titan.recompute_flops == LAYERS * 2 * TOKENS * (DIM * KV + DIM * DIM + DIM * FFN)
    assert titan.recompute.attention_s == 0
    block_memory = memory_seconds(LAYERS * TOKENS * block_pass_bytes(layout("torchtitan")).block, H100)
    assert titan.recompute.memory_s == pytest.approx(block_memory)


def activations(runtime, parallel=None):
    result = estimate(document(parallel, recompute="selective"), CLUSTER, runtime=runtime)
    return next(term.value for term in result.memory[0].terms if term.name == "activations")


def test_torchtitans_per_op_checkpointing_keeps_the_block_input_attention_and_every_other_product():
    sbh, sbkv, sbf, sba = TOKENS * DIM, TOKENS * KV, TOKENS * FFN, TOKENS * HEADS
    # Block input, q, v, attention output, gate (w1), down projection (w2), in bf16; the logsumexp in fp32.
    per_layer = 2 * (sbh + sbh + sbkv + sbh + sbf + sbh) + 4 * sba
    assert activations("torchtitan") == LAYERS * per_layer


def test_torchtitans_per_op_checkpointing_under_sequence_parallel_keeps_the_reduce_scatters_too():
    tp = 4
    parallel = {"tp": tp, "dp_shard": 2, "sequence_parallel": True}
    sbh, sbkv, sbf, sba = TOKENS * DIM, TOKENS * KV, TOKENS * FFN, TOKENS * HEADS
    per_layer = 2 * (sbh / tp + sbh / tp + sbkv / tp + sbh / tp + sbf / tp + sbh + 2 * sbh / tp) + 4 * sba / tp
    assert activations("torchtitan", parallel) == pytest.approx(LAYERS * per_layer)


def megatron_activations(model, parallel, attention):
    doc = {
        "model": model,
        "parallel": parallel,
        "compute": {"precision": "bf16", "recompute": "none"},
        "data": {"micro_batch": 1},
    }
    result = estimate(doc, CLUSTER, runtime="megatron", attention=attention)
    return next(term.value for term in result.memory[0].terms if term.name == "activations")


def test_the_megatron_export_keeps_korthikantis_gpt_layer():
    s, h, a, t, layers = 2048, 2048, 16, 4, 2
    gpt = {"layers": layers, "dim": h, "heads": a, "kv_heads": a, "ffn": 4 * h, "vocab": 51200, "seq_len": s}
    gpt["mlp"] = "gelu"
    gpt["tie_embeddings"] = True
    parallel = {"tp": t, "dp_shard": 2, "sequence_parallel": True}
    assert megatron_activations(gpt, parallel, "unfused") == pytest.approx(layers * s * h / t * (34 + 5 * a * s / h))


def test_the_megatron_export_of_a_llama_keeps_flash_attentions_logsumexp_and_swiglus_gate_and_up():
    t = 4
    llama = {**MODEL, "seq_len": SEQ}
    parallel = {"tp": t, "dp_shard": 2, "sequence_parallel": True}
    sbh, sbkv, sbf, sba = SEQ * DIM, SEQ * KV, SEQ * FFN, SEQ * HEADS
    # Norm and QKV inputs, Q and K, V, projection input, MLP norm and input, gate and up, their product; no dropout.
    per_layer = (2 * (sbh + sbh + sbh + sbkv + sbkv + sbh + sbh + sbh + 2 * sbf + sbf) + 4 * sba) / t
    assert megatron_activations(llama, parallel, "flash") == pytest.approx(LAYERS * per_layer)


def test_recomputing_every_second_block_keeps_full_activations_in_the_others():
    def kept(recompute, every=1):
        doc = document(recompute=recompute)
        doc["compute"]["recompute_every"] = every
        return next(t.value for t in estimate(doc, CLUSTER).memory[0].terms if t.name == "activations")

    full, none = kept("full") / LAYERS, kept("none") / LAYERS
    assert kept("full", every=2) == pytest.approx(2 * full + 2 * none)
    assert kept("full", every=4) == pytest.approx(full + 3 * none)


def test_recomputing_every_second_block_repeats_half_the_blocks_forward():
    def compute_every(every):
        doc = document(recompute="full")
        doc["compute"]["recompute_every"] = every
        return stages_compute(Layout(parse_config(doc, runnable=False)), parse_cluster(CLUSTER), [0])

    every_block, every_second = compute_every(1), compute_every(2)
    assert every_second.recompute.total_s == pytest.approx(every_block.recompute.total_s / 2)
    assert every_second.recompute_flops == pytest.approx(every_block.recompute_flops / 2)
    assert every_second.forward.total_s == every_block.forward.total_s
