"""Exporting a layout to torchtitan and Megatron-LM: the same degrees, schedule, batch, precision and
recompute, and a clear refusal where the other trainer has no equivalent."""

import re
import tomllib

import pytest

from trainer.config import ConfigError, parse_config
from trainer.plan.estimate import estimate
from trainer.plan.export import ExportError, export_job, to_megatron_args, to_torchtitan_toml
from trainer.plan.presets import with_preset
from trainer.plan.search import search

INTERLEAVED = {
    "tp": 8,
    "pp": 4,
    "pp_schedule": "Interleaved1F1B",
    "stages_per_rank": 2,
    "microbatches": 8,
    "dp_shard": 2,
}


def config_of(parallel: dict, micro_batch: int = 256, model: dict | None = None, **sections):
    document = {
        "model": model or {"preset": "llama3-70b"},
        "parallel": parallel,
        "data": {"micro_batch": micro_batch},
        **sections,
    }
    return parse_config(with_preset(document), runnable=False)


def megatron(config) -> dict[str, str | bool]:
    """{"--num-layers": "80", "--swiglu": True, ...}"""
    arguments = to_megatron_args(config)
    assert all(argument.startswith("--") for argument in arguments)
    return {name: value or True for name, _, value in (argument.partition("=") for argument in arguments)}


def test_torchtitan_toml_parses_and_holds_the_layout():
    config = config_of(INTERLEAVED, compute={"recompute": "selective"}, steps=500)
    job = tomllib.loads(to_torchtitan_toml(config))
    assert job["parallelism"] == {
        "data_parallel_replicate_degree": 1,
        "data_parallel_shard_degree": 2,
        "fsdp_reshard_after_forward": "always",
        "tensor_parallel_degree": 8,
        "disable_loss_parallel": False,
        "enable_async_tensor_parallel": False,
        "pipeline_parallel_degree": 4,
        "pipeline_parallel_schedule": "Interleaved1F1B",
        "pipeline_parallel_layers_per_stage": 10,
        "pipeline_parallel_first_stage_less_layers": 0,
        "pipeline_parallel_last_stage_less_layers": 0,
        "pipeline_parallel_microbatch_size": 32,
        "context_parallel_degree": 1,
        "expert_parallel_degree": 1,
    }
    assert job["training"]["local_batch_size"] == 256
    assert job["training"]["global_batch_size"] == 512
    assert job["training"]["seq_len"] == 8192
    assert job["training"]["steps"] == 500
    assert job["training"]["mixed_precision_param"] == "bfloat16"
    assert job["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    assert job["compile"] == {"enable": False, "components": ["model"]}
    assert job["model"]["name"] == "llama3"
    assert job["optimizer"]["lr"] == config.optimizer.lr
    assert job["lr_scheduler"]["min_lr_factor"] == config.optimizer.min_lr_ratio


def test_torchtitan_says_what_differs_in_comments():
    text = to_torchtitan_toml(config_of(INTERLEAVED, compute={"recompute": "selective"}))
    comments = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    assert "n_layers=80" in comments and "n_kv_heads=8" in comments and "28672" in comments
    assert "selective" in comments and "weight decay" in comments and "dataset" in comments


@pytest.mark.parametrize(
    ("parallel", "micro_batch", "sections", "expected"),
    [
        (
            {"dp_replicate": 8, "tp": 8},
            64,
            {},
            {"parallelism": {"data_parallel_replicate_degree": 8, "data_parallel_shard_degree": 1}},
        ),
        (
            {"dp_shard": 8, "tp": 8, "reshard_after_forward": False},
            64,
            {},
            {"parallelism": {"fsdp_reshard_after_forward": "never"}},
        ),
        (
            {"pp": 8, "pp_schedule": "ZBVZeroBubble", "stages_per_rank": 2, "microbatches": 16, "tp": 8},
            512,
            {},
            {
                "parallelism": {
                    "pipeline_parallel_schedule": "ZBVZeroBubble",
                    "pipeline_parallel_layers_per_stage": 5,
                    "pipeline_parallel_microbatch_size": 32,
                }
            },
        ),
        (
            {"cp": 8, "tp": 8, "loss_parallel": False},
            512,
            {},
            {"parallelism": {"context_parallel_degree": 8, "disable_loss_parallel": True}},
        ),
        ({"tp": 8, "dp_shard": 8}, 8, {"compute": {"precision": "fp8"}}, {"model": {"converters": ["float8"]}}),
        (
            {"tp": 8, "dp_shard": 8},
            8,
            {"compute": {"precision": "fp32"}},
            {"training": {"mixed_precision_param": "float32"}},
        ),
        ({"tp": 8, "dp_shard": 8}, 8, {"optimizer": {"grad_clip": 0}}, {"training": {"max_norm": float("inf")}}),
        (
            {"tp": 8, "dp_shard": 8},
            8,
            {"compute": {"recompute": "full", "compile": False}},
            {"activation_checkpoint": {"mode": "full"}},
        ),
    ],
)
def test_torchtitan_carries_each_choice(parallel, micro_batch, sections, expected):
    job = tomllib.loads(to_torchtitan_toml(config_of(parallel, micro_batch, **sections)))
    for section, values in expected.items():
        for key, value in values.items():
            assert job[section][key] == value, (section, key)


def test_torchtitan_without_sharding_has_no_fsdp_policy():
    job = tomllib.loads(to_torchtitan_toml(config_of({"dp_replicate": 8, "tp": 8}, 64)))
    assert "fsdp_reshard_after_forward" not in job["parallelism"]


@pytest.mark.parametrize(
    ("parallel", "model", "sections", "field"),
    [
        ({"dp_shard": 8, "zero_stage": 1}, None, {}, "parallel.zero_stage"),
        ({"dp_shard": 8, "zero_stage": 2}, None, {}, "parallel.zero_stage"),
        ({"tp": 8, "sequence_parallel": False}, None, {}, "parallel.sequence_parallel"),
        ({"dp_shard": 8}, {"preset": "mixtral-8x7b"}, {}, "model.experts"),
        ({"dp_shard": 8}, {"preset": "gpt3-175b"}, {}, "model.mlp"),
        ({"dp_shard": 8}, {"preset": "gpt3-175b"}, {}, "model.tie_embeddings"),
        ({"dp_shard": 8}, None, {"optimizer": {"offload": True}}, "optimizer.offload"),
        ({"dp_shard": 8}, {"preset": "llama3-70b", "rope_scaling": {}}, {}, "model.rope_scaling"),
        ({"dp_shard": 8}, {"preset": "llama3-70b", "parallel_blocks": True}, {}, "model.parallel_blocks"),
    ],
)
def test_torchtitan_refuses_what_it_cannot_run(parallel, model, sections, field):
    with pytest.raises(ExportError) as refused:
        to_torchtitan_toml(config_of(parallel, 8, model, **sections))
    assert field in refused.value.errors
    assert "torchtitan" in refused.value.errors[field]


def test_megatron_arguments_hold_the_model_and_the_layout():
    arguments = megatron(config_of(INTERLEAVED, compute={"recompute": "full"}, steps=500))
    expected = {
        "--num-layers": "80",
        "--hidden-size": "8192",
        "--num-attention-heads": "64",
        "--group-query-attention": True,
        "--num-query-groups": "8",
        "--ffn-hidden-size": "28672",
        "--seq-length": "8192",
        "--max-position-embeddings": "8192",
        "--swiglu": True,
        "--untie-embeddings-and-output-weights": True,
        "--normalization": "RMSNorm",
        "--position-embedding-type": "rope",
        "--tensor-model-parallel-size": "8",
        "--sequence-parallel": True,
        "--pipeline-model-parallel-size": "4",
        "--num-layers-per-virtual-pipeline-stage": "10",
        "--context-parallel-size": "1",
        "--use-torch-fsdp2": True,
        "--micro-batch-size": "32",
        "--global-batch-size": "512",
        "--train-iters": "500",
        "--bf16": True,
        "--recompute-granularity": "full",
        "--recompute-method": "uniform",
        "--recompute-num-layers": "1",
    }
    for name, value in expected.items():
        assert arguments[name] == value, name
    assert "--expert-model-parallel-size" not in arguments and "--fp8-format" not in arguments


@pytest.mark.parametrize(
    ("parallel", "model", "sections", "present", "absent"),
    [
        (
            {"dp_shard": 8, "zero_stage": 1, "tp": 8},
            None,
            {},
            {"--use-distributed-optimizer": True},
            ["--num-distributed-optimizer-instances", "--use-torch-fsdp2"],
        ),
        (
            {"dp_shard": 4, "dp_replicate": 2, "zero_stage": 1, "tp": 8},
            None,
            {},
            {"--use-distributed-optimizer": True, "--num-distributed-optimizer-instances": "2"},
            [],
        ),
        (
            {"dp_shard": 8, "zero_stage": 2, "tp": 8},
            None,
            {},
            {"--use-megatron-fsdp": True, "--data-parallel-sharding-strategy": "optim_grads"},
            [],
        ),
        ({"dp_replicate": 8, "tp": 8}, None, {}, {}, ["--use-distributed-optimizer", "--use-torch-fsdp2"]),
        (
            {"dp_shard": 8, "tp": 8, "reshard_after_forward": False},
            None,
            {},
            {"--torch-fsdp2-no-reshard-after-forward": True},
            [],
        ),
        (
            {"pp": 4, "microbatches": 4, "tp": 8, "sequence_parallel": False},
            None,
            {},
            {"--pipeline-model-parallel-size": "4"},
            ["--sequence-parallel", "--num-layers-per-virtual-pipeline-stage"],
        ),
        (
            {"dp_shard": 8, "ep": 8},
            {"preset": "mixtral-8x7b"},
            {},
            {"--num-experts": "8", "--moe-router-topk": "2", "--expert-model-parallel-size": "8"},
            ["--moe-layer-freq", "--moe-ffn-hidden-size"],
        ),
        (
            {"dp_shard": 8, "ep": 8},
            {"preset": "mixtral-8x7b", "moe": {"dense_layers": 3, "dense_ffn": 28672}},
            {},
            {"--moe-layer-freq": "([0]*3+[1]*29)", "--ffn-hidden-size": "28672", "--moe-ffn-hidden-size": "14336"},
            [],
        ),
        ({"dp_shard": 8}, {"preset": "gpt3-175b"}, {}, {}, ["--swiglu", "--untie-embeddings-and-output-weights"]),
        (
            {"dp_shard": 8, "tp": 8},
            None,
            {"compute": {"precision": "fp8"}},
            {"--bf16": True, "--fp8-format": "hybrid"},
            [],
        ),
        ({"dp_shard": 8, "tp": 8}, None, {"compute": {"precision": "fp32"}}, {}, ["--bf16"]),
        (
            {"dp_shard": 8, "tp": 8},
            None,
            {"compute": {"recompute": "selective"}},
            {"--recompute-granularity": "selective"},
            ["--recompute-method"],
        ),
    ],
)
def test_megatron_carries_each_choice(parallel, model, sections, present, absent):
    arguments = megatron(config_of(parallel, 8, model, **sections))
    for name, value in present.items():
        assert arguments[name] == value, name
    for name in absent:
        assert name not in arguments


@pytest.mark.parametrize("schedule", ["GPipe", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_megatron_refuses_a_schedule_it_lacks(schedule):
    stages = 1 if schedule == "GPipe" else 2
    config = config_of({"pp": 4, "pp_schedule": schedule, "stages_per_rank": stages, "microbatches": 8}, 8)
    with pytest.raises(ExportError) as refused:
        to_megatron_args(config)
    assert refused.value.errors == {
        "parallel.pp_schedule": f"Megatron-LM runs 1F1B and interleaved 1F1B only, not {schedule}; use 1F1B or "
        "Interleaved1F1B"
    }


def test_megatron_refuses_rope_scaling_it_has_no_flags_for():
    with pytest.raises(ExportError) as refused:
        to_megatron_args(config_of({"dp_shard": 8}, 8, {"preset": "llama3-70b", "rope_scaling": {}}))
    assert "Megatron-LM" in refused.value.errors["model.rope_scaling"]


def test_megatron_and_its_pricing_refuse_parallel_blocks_its_gpt_model_lacks():
    config = config_of({"dp_shard": 8}, 8, {"preset": "llama3-70b", "parallel_blocks": True})
    with pytest.raises(ExportError) as refused:
        to_megatron_args(config)
    assert refused.value.errors == {
        "model.parallel_blocks": "Megatron-LM's GPT model runs attention and the MLP one after the other, each behind "
        "a norm of its own; use false"
    }
    document = {"model": {"preset": "llama3-70b", "parallel_blocks": True}, "parallel": {"dp_shard": 8}}
    for runtime in ("megatron", "torchtitan"):
        with pytest.raises(ConfigError) as unpriced:
            estimate(document, {"gpu": "H100-SXM", "nodes": 1}, runtime=runtime)
        assert list(unpriced.value.errors) == ["model.parallel_blocks"]
    assert estimate(document, {"gpu": "H100-SXM", "nodes": 1}).step_s > 0


def test_megatron_refuses_hybrid_sharding_with_fsdp():
    with pytest.raises(ExportError) as refused:
        to_megatron_args(config_of({"dp_shard": 4, "dp_replicate": 2, "tp": 8}, 8))
    assert "parallel.dp_replicate" in refused.value.errors


def test_searched_layouts_export_or_are_refused_with_a_field():
    result = search({"preset": "llama3-8b"}, {"gpu": "H100-SXM", "nodes": 1}, 32, limit=10)
    for found in result.results + result.pareto:
        for exporter in (to_torchtitan_toml, to_megatron_args):
            try:
                text = exporter(found.config)
            except ExportError as refused:
                assert refused.errors and all(field.count(".") == 1 for field in refused.errors)
            else:
                if exporter is to_torchtitan_toml:
                    job = tomllib.loads(text)
                    assert job["parallelism"]["tensor_parallel_degree"] == found.config.parallel.tp
                    assert job["parallelism"]["pipeline_parallel_degree"] == found.config.parallel.pp


# Each preset's published shape, from its model card, paper or released config (never from
# trainer/plan/presets.py): layers, hidden size, heads, key/value heads, feed-forward size, vocabulary,
# training sequence length, rotary base (None: GPT-3 learns absolute positions).
PUBLISHED_SHAPES = {
    "llama2-7b": (32, 4096, 32, 32, 11008, 32000, 4096, 10_000),
    "llama2-13b": (40, 5120, 40, 40, 13824, 32000, 4096, 10_000),
    "llama2-70b": (80, 8192, 64, 8, 28672, 32000, 4096, 10_000),
    "llama3-8b": (32, 4096, 32, 8, 14336, 128256, 8192, 500_000),
    "llama3-70b": (80, 8192, 64, 8, 28672, 128256, 8192, 500_000),
    "llama3-405b": (126, 16384, 128, 8, 53248, 128256, 8192, 500_000),
    "gpt3-175b": (96, 12288, 96, 96, 4 * 12288, 50257, 2048, None),
    "mixtral-8x7b": (32, 4096, 32, 8, 14336, 32000, 32768, 1_000_000),
}
# Megatron-LM pads a vocabulary to a multiple of 128 × 8 where tensor parallelism would not split it.
MEGATRON_VOCAB_MULTIPLE = 128 * 8


def trained_vocab(published: int) -> int:
    return published if published % 8 == 0 else -(-published // MEGATRON_VOCAB_MULTIPLE) * MEGATRON_VOCAB_MULTIPLE


@pytest.mark.parametrize("preset", list(PUBLISHED_SHAPES))
def test_megatron_arguments_carry_each_presets_published_shape(preset):
    layers, hidden, heads, kv_heads, ffn, vocab, seq_len, rope_theta = PUBLISHED_SHAPES[preset]
    arguments = megatron(config_of({}, 1, model={"preset": preset}))
    assert int(arguments["--num-layers"]) == layers
    assert int(arguments["--hidden-size"]) == hidden
    assert int(arguments["--num-attention-heads"]) == heads
    assert int(arguments.get("--num-query-groups", heads)) == kv_heads
    assert int(arguments["--ffn-hidden-size"]) == ffn
    # NullTokenizer adds an end-of-document id to --vocab-size; nothing pads the sum.
    assert arguments["--tokenizer-type"] == "NullTokenizer"
    assert arguments["--make-vocab-size-divisible-by"] == "1"
    assert int(arguments["--vocab-size"]) + 1 == trained_vocab(vocab)
    assert int(arguments["--seq-length"]) == seq_len
    if rope_theta is not None:
        assert float(arguments["--rotary-base"]) == rope_theta


@pytest.mark.parametrize("preset", list(PUBLISHED_SHAPES))
def test_torchtitan_jobs_carry_each_presets_published_shape_or_name_what_they_cannot(preset):
    layers, hidden, heads, kv_heads, ffn, vocab, seq_len, rope_theta = PUBLISHED_SHAPES[preset]
    config = config_of({}, 1, model={"preset": preset})
    if preset in ("gpt3-175b", "mixtral-8x7b"):
        with pytest.raises(ExportError) as refused:
            to_torchtitan_toml(config)
        assert set(refused.value.errors) & {"model.mlp", "model.experts"}
        return
    text = to_torchtitan_toml(config)
    (flavor,) = re.findall(r"TransformerModelArgs\((.*?)\)", text)
    arguments = dict(pair.split("=") for pair in flavor.split(", "))
    assert int(arguments["n_layers"]) == layers
    assert int(arguments["dim"]) == hidden
    assert int(arguments["n_heads"]) == heads
    assert int(arguments["n_kv_heads"]) == kv_heads
    assert f"feed-forward size of {ffn}" in text
    assert int(arguments["vocab_size"]) == vocab
    assert float(arguments["rope_theta"]) == rope_theta
    job = tomllib.loads(text)
    assert job["training"]["seq_len"] == seq_len
    assert str(vocab) in job["model"]["hf_assets_path"] and "FILL IN" in job["model"]["hf_assets_path"]


def test_the_demo_learning_rate_is_exported_as_set_with_a_warning():
    demo = config_of(INTERLEAVED)
    job = export_job(demo, "torchtitan")
    assert tomllib.loads(job["text"])["optimizer"]["lr"] == 0.003
    (warning,) = job["warnings"]
    assert warning["field"] == "optimizer.lr" and "demo default" in warning["message"]
    assert "70.6 billion parameters" in warning["message"]

    chosen = config_of(INTERLEAVED, optimizer={"lr": 1.5e-4})
    job = export_job(chosen, "megatron")
    assert "--lr=0.00015 \\" in job["text"].splitlines()
    assert job["warnings"] == []


UNEVEN = {"tp": 8, "pp": 16, "pp_schedule": "1F1B", "microbatches": 16, "dp_shard": 2}


def test_an_uneven_pipeline_split_exports_as_one_block_fewer_on_the_first_and_last_stage():
    """Llama 3.1 405B's 126 blocks on 16 stages: 7, 8, …, 8, 7."""
    config = config_of(UNEVEN, micro_batch=16, model={"preset": "llama3-405b"})
    parallelism = tomllib.loads(to_torchtitan_toml(config))["parallelism"]
    assert parallelism["pipeline_parallel_layers_per_stage"] == 8
    assert parallelism["pipeline_parallel_first_stage_less_layers"] == 1
    assert parallelism["pipeline_parallel_last_stage_less_layers"] == 1
    arguments = megatron(config)
    assert arguments["--account-for-embedding-in-pipeline-split"] is True
    assert arguments["--account-for-loss-in-pipeline-split"] is True
    assert "--num-layers-per-virtual-pipeline-stage" not in arguments


def test_an_even_pipeline_split_exports_without_accounting_for_the_embedding():
    config = config_of(INTERLEAVED)
    assert "--account-for-embedding-in-pipeline-split" not in megatron(config)
    assert megatron(config)["--num-layers-per-virtual-pipeline-stage"] == "10"


def test_recomputing_every_nth_block_exports_as_torchtitans_per_layer_checkpointing_and_megatron_refuses_it():
    config = config_of(INTERLEAVED, compute={"recompute": "full", "recompute_every": 2})
    checkpointing = tomllib.loads(to_torchtitan_toml(config))["activation_checkpoint"]
    assert checkpointing == {"mode": "selective", "selective_ac_option": "2"}
    with pytest.raises(ExportError) as refused:
        to_megatron_args(config)
    assert "compute.recompute_every" in refused.value.errors
    selective = config_of(INTERLEAVED, compute={"recompute": "selective", "recompute_every": 2})
    with pytest.raises(ExportError) as refused:
        to_torchtitan_toml(selective)
    assert "compute.recompute_every" in refused.value.errors
