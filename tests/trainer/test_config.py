import pytest

from trainer.config import ConfigError, RunConfig, parse_config


def errors_of(document) -> dict[str, str]:
    with pytest.raises(ConfigError) as raised:
        parse_config(document)
    return raised.value.errors


def test_an_empty_document_takes_the_defaults():
    config = parse_config({})
    assert config == RunConfig()
    assert config.model.dim % config.model.heads == 0
    assert config.model.heads % config.model.kv_heads == 0


def test_heads_that_do_not_divide_dim_are_reported_on_model_heads():
    errors = errors_of({"model": {"dim": 128, "heads": 3, "kv_heads": 1}})
    assert list(errors) == ["model.heads"]
    assert "must divide dim=128" in errors["model.heads"]


def test_kv_heads_that_do_not_divide_heads_are_reported_on_model_kv_heads():
    errors = errors_of({"model": {"heads": 4, "kv_heads": 3}})
    assert list(errors) == ["model.kv_heads"]
    assert "must divide heads=4" in errors["model.kv_heads"]


def test_zero_data_parallel_ranks_are_reported_on_the_field():
    errors = errors_of({"parallel": {"dp_replicate": 0}})
    assert list(errors) == ["parallel.dp_replicate"]
    assert "greater than or equal to 1" in errors["parallel.dp_replicate"]


def test_an_unknown_field_is_named_by_its_dotted_path():
    assert errors_of({"model": {"bogus": 1}}) == {"model.bogus": "is not a known field"}


def test_every_bad_field_is_reported_at_once():
    errors = errors_of({"steps": 0, "optimizer": {"lr": -1}, "data": {"micro_batch": 0}})
    assert set(errors) == {"steps", "optimizer.lr", "data.micro_batch"}


@pytest.mark.parametrize("document", [[], "steps: 10", None, 3])
def test_a_document_that_is_not_an_object_is_reported_on_config(document):
    assert errors_of(document) == {"config": "must be a JSON object"}


def test_rules_across_sections_name_the_field_to_change():
    with pytest.raises(ConfigError) as raised:
        parse_config({"model": {"seq_len": 20000}, "data": {"corpus_bytes": 10000}})
    assert raised.value.errors == {
        "data.corpus_bytes": "must be at least model.seq_len + 1 = 20001 to cut one training window"
    }


def test_an_injected_fault_must_name_an_existing_rank():
    assert errors_of({"parallel": {"dp_replicate": 2}, "faults": {"crash_at_step": 3, "crash_rank": 2}}) == {
        "faults.crash_rank": "must be below the world size 2"
    }


@pytest.mark.parametrize(
    ("parallel", "model", "field", "message"),
    [
        ({"tp": 3}, {}, "parallel.tp", "must divide model.heads=4; valid choices are [1, 2]"),
        ({"tp": 4}, {"kv_heads": 2}, "parallel.tp", "must divide model.kv_heads=2; valid choices are [1, 2]"),
        ({"cp": 2}, {"seq_len": 130}, "model.seq_len", "must be divisible by 4 (2 × cp = 4 load-balanced chunks)"),
        ({"tp": 2}, {"seq_len": 129}, "model.seq_len", "must be divisible by 2 (tp = 2 sequence-parallel shards)"),
        (
            {"pp": 5, "microbatches": 5},
            {"layers": 4},
            "parallel.pp",
            "or 6 (the embedding and the output counted as a block each: the first and last stages hold one "
            "block fewer); valid pp here: [2, 3, 4]",
        ),
        ({"pp": 2, "microbatches": 1}, {"layers": 4}, "parallel.microbatches", "must be at least pp=2"),
        ({"pp": 2, "microbatches": 3}, {"layers": 4}, "parallel.microbatches", "must divide data.micro_batch=8"),
        (
            {"pp": 2, "microbatches": 2, "pp_schedule": "DualPipeV"},
            {"layers": 4},
            "parallel.stages_per_rank",
            "must be 2 for DualPipeV",
        ),
        (
            {"pp": 2, "microbatches": 2, "pp_schedule": "Interleaved1F1B"},
            {"layers": 4},
            "parallel.stages_per_rank",
            "must be at least 2 for Interleaved1F1B",
        ),
        ({"stages_per_rank": 2}, {}, "parallel.stages_per_rank", "must be 1 without pipeline parallelism"),
    ],
)
def test_layout_rules_name_the_field_and_the_valid_choices(parallel, model, field, message):
    errors = errors_of({"parallel": parallel, "model": model})
    assert message in errors[field], errors


def test_recomputing_every_nth_block_needs_a_recompute_mode_and_that_many_blocks():
    assert (
        "needs compute.recompute 'full' or 'selective'"
        in errors_of({"compute": {"recompute_every": 2}})["compute.recompute_every"]
    )
    too_sparse = {"model": {"layers": 4}, "compute": {"recompute": "full", "recompute_every": 5}}
    assert errors_of(too_sparse) == {"compute.recompute_every": "must be at most model.layers=4"}
    config = parse_config({"model": {"layers": 4}, "compute": {"recompute": "selective", "recompute_every": 2}})
    assert [config.compute.recomputes_block(index) for index in range(4)] == [True, False, True, False]


def test_a_valid_three_dimensional_layout_counts_its_ranks():
    config = parse_config({"parallel": {"pp": 2, "dp_shard": 2, "tp": 2, "microbatches": 2}})
    assert config.parallel.world_size == 8 and config.parallel.data_parallel == 2


@pytest.mark.parametrize(
    "parallel, path",
    [
        ({}, "none"),
        ({"tp": 2, "pp": 2, "microbatches": 2}, "none"),
        ({"dp_replicate": 4}, "ddp"),
        ({"dp_shard": 2}, "fsdp"),
        ({"cp": 2}, "fsdp"),
        ({"dp_replicate": 2, "dp_shard": 2}, "hsdp"),
        # DDP takes neither DTensor parameters nor a pipeline's backward per microbatch.
        ({"dp_replicate": 2, "tp": 2}, "hsdp"),
        ({"dp_replicate": 2, "pp": 2, "microbatches": 2}, "hsdp"),
    ],
)
def test_only_replicas_of_the_whole_model_take_ddp(parallel, path):
    assert parse_config({"parallel": parallel}).parallel.data_parallel_path == path


def test_compile_with_tensor_parallelism_is_refused_only_with_selective_recompute():
    refused = errors_of({"parallel": {"tp": 2}, "compute": {"compile": True, "recompute": "selective"}})
    assert set(refused) == {"compute.compile"} and "recompute 'full' or 'none'" in refused["compute.compile"]
    for recompute in ("none", "full"):
        assert parse_config(
            {"parallel": {"tp": 2}, "compute": {"compile": True, "recompute": recompute}}
        ).compute.compile
    assert parse_config({"parallel": {"dp_shard": 2}, "compute": {"compile": True, "recompute": "selective"}})


def test_faults_are_all_off_by_default():
    faults = parse_config({}).faults
    assert faults.crash_at_step is faults.kill_at_step is faults.hang_at_step is faults.nan_at_step is None
    assert faults.slow_rank is faults.corrupt_checkpoint_step is None and faults.slow_ms == 0


@pytest.mark.parametrize("field", ["crash_rank", "kill_rank", "hang_rank", "slow_rank"])
def test_every_faulty_rank_must_exist(field):
    assert errors_of({"parallel": {"dp_shard": 2}, "faults": {field: 2}}) == {
        f"faults.{field}": "must be below the world size 2"
    }


def test_fault_steps_start_at_one_and_slow_ms_stays_within_ten_minutes():
    document = {"faults": {"kill_at_step": 0, "hang_at_step": 0, "nan_at_step": 0, "slow_ms": 600_001}}
    assert errors_of(document) == {
        "faults.kill_at_step": "Input should be greater than or equal to 1",
        "faults.hang_at_step": "Input should be greater than or equal to 1",
        "faults.nan_at_step": "Input should be greater than or equal to 1",
        "faults.slow_ms": "Input should be less than or equal to 600000",
    }
    assert errors_of({"faults": {"slow_ms": -1, "corrupt_checkpoint_step": 0}}) == {
        "faults.slow_ms": "Input should be greater than or equal to 0",
        "faults.corrupt_checkpoint_step": "Input should be greater than or equal to 1",
    }


def test_a_fault_step_past_the_last_step_is_allowed():
    faults = {"kill_at_step": 50, "hang_at_step": 50, "nan_at_step": 50, "corrupt_checkpoint_step": 50}
    config = parse_config({"steps": 10, "checkpoint": {"interval_steps": 5}, "faults": faults})
    assert config.faults.corrupt_checkpoint_step == 50


@pytest.mark.parametrize(
    ("checkpoint", "step", "message"),
    [
        (
            {"interval_steps": 5},
            7,
            "no checkpoint is saved at step 7 (checkpoint.interval_steps is 5); use a multiple of 5 or the final "
            "step 20",
        ),
        (
            {"interval_minutes": 10},
            7,
            "no checkpoint is saved at step 7 (checkpoint.interval_steps is 0); use the final step 20 or set "
            "checkpoint.interval_steps",
        ),
        ({}, 20, "no checkpoint is saved at step 20: checkpointing is off; set checkpoint.interval_steps"),
    ],
)
def test_a_corrupted_checkpoint_must_be_one_that_is_saved(checkpoint, step, message):
    document = {"steps": 20, "checkpoint": checkpoint, "faults": {"corrupt_checkpoint_step": step}}
    assert errors_of(document) == {"faults.corrupt_checkpoint_step": message}


@pytest.mark.parametrize(("checkpoint", "step"), [({"interval_steps": 5}, 15), ({"interval_minutes": 10}, 20)])
def test_a_corrupted_checkpoint_may_be_a_periodic_or_the_final_save(checkpoint, step):
    document = {"steps": 20, "checkpoint": checkpoint, "faults": {"corrupt_checkpoint_step": step}}
    assert parse_config(document).faults.corrupt_checkpoint_step == step


def test_a_global_batch_is_whole_passes_of_every_data_parallel_rank():
    config = parse_config({"parallel": {"dp_shard": 4}, "data": {"micro_batch": 2, "global_batch": 32}})
    assert (config.sequences_per_pass, config.global_batch, config.accumulation_steps) == (8, 32, 4)
    assert config.tokens_per_step == 32 * config.model.seq_len
    one_pass = parse_config({"parallel": {"dp_shard": 4}, "data": {"micro_batch": 2}})
    assert (one_pass.global_batch, one_pass.accumulation_steps) == (8, 1)

    with pytest.raises(ConfigError) as refused:
        parse_config({"parallel": {"dp_shard": 4}, "data": {"micro_batch": 2, "global_batch": 30}})
    assert refused.value.errors == {
        "data.global_batch": "must be a multiple of data.micro_batch × data-parallel ranks = 2 × 4 = 8; "
        "valid choices near it: [8, 16, 24, 32, 40, 48]"
    }


@pytest.mark.parametrize(
    "document, message",
    [
        ({}, "needs data.dataset: the demo corpus has no end-of-text tokens"),
        ({"data": {"dataset": "/data/tokens"}, "parallel": {"pp": 2, "microbatches": 2}}, "parallel.pp > 1"),
        ({"data": {"dataset": "/data/tokens"}, "parallel": {"cp": 2}}, "parallel.cp > 1"),
    ],
)
def test_a_document_mask_needs_a_dataset_and_no_pipeline_or_context_parallelism(document, message):
    data = {**document.get("data", {}), "document_mask": True}
    with pytest.raises(ConfigError) as refused:
        parse_config({**document, "data": data})
    assert message in refused.value.errors["data.document_mask"]
    assert parse_config({"data": {"dataset": "/data/tokens", "document_mask": True}, "parallel": {"tp": 2}})


def test_tied_embeddings_run_within_one_pipeline_stage_and_across_stages():
    tied = {"model": {"layers": 4, "tie_embeddings": True}}
    assert parse_config({**tied, "parallel": {"tp": 2, "dp_shard": 2}}).model.tie_embeddings
    assert parse_config({**tied, "parallel": {"pp": 2, "microbatches": 2}}).parallel.pp == 2


@pytest.mark.parametrize(
    ("model", "parallel", "compute"),
    [
        ({"mlp": "gelu", "tie_embeddings": True}, {"tp": 2, "sequence_parallel": False}, {"recompute": "selective"}),
        ({"experts": 4, "top_k": 2, "moe": {"dense_layers": 1}}, {"dp_shard": 2, "cp": 2, "ep": 2}, {"compile": True}),
        ({}, {"pp": 2, "pp_schedule": "ZBVZeroBubble", "stages_per_rank": 2, "microbatches": 2}, {"recompute": "full"}),
        ({}, {"dp_shard": 2, "tp": 2}, {"compile": True, "kernels": "triton"}),
    ],
)
def test_parallel_blocks_run_with_every_block_layout_and_recompute_the_trainer_runs(model, parallel, compute):
    document = {"model": {"layers": 4, "parallel_blocks": True, **model}, "parallel": parallel, "compute": compute}
    assert parse_config(document).model.parallel_blocks
    assert "model.parallel_blocks" in errors_of({"model": {"parallel_blocks": "true"}})


def test_gpt3s_gelu_blocks_run():
    assert parse_config({"model": {"layers": 2, "mlp": "gelu"}, "parallel": {"tp": 2}}).model.mlp == "gelu"


def test_fp8_runs_in_every_layout_and_names_its_scaling_recipes():
    fp8 = {"compute": {"precision": "fp8", "fp8_scaling": "rowwise"}}
    parallel = {"dp_shard": 2, "tp": 2, "pp": 2, "microbatches": 2}
    assert parse_config({**fp8, "parallel": parallel}).compute.fp8_scaling == "rowwise"
    assert parse_config({**fp8, "model": {"experts": 4, "top_k": 2}, "parallel": {"tp": 2}}).model.experts == 4
    assert set(errors_of({"compute": {"fp8_scaling": "blockwise"}})) == {"compute.fp8_scaling"}


def test_a_mixture_of_experts_runs_where_the_trainer_splits_its_experts_and_is_refused_elsewhere():
    moe = {"model": {"layers": 2, "experts": 4, "top_k": 2}}
    assert parse_config({**moe, "parallel": {"dp_shard": 4, "cp": 2, "ep": 4}}).parallel.ep == 4
    assert parse_config({**moe, "parallel": {"dp_shard": 2, "tp": 2, "ep": 2}}).parallel.tp == 2
    # Tensor parallelism has the router take a part of each sequence, sequence parallel or not.
    unsplittable = {"model": {**moe["model"], "seq_len": 255}, "parallel": {"tp": 2, "sequence_parallel": False}}
    assert set(errors_of(unsplittable)) == {"model.seq_len"}
    refusals = [
        ({"parallel": {"dp_replicate": 2, "ep": 2}}, "parallel.ep"),
        (
            {"parallel": {"cp": 2}, "model": {**moe["model"], "moe": {"capacity_factor": 1.5}}},
            "model.moe.capacity_factor",
        ),
    ]
    for sections, field in refusals:
        document = {**moe, **sections}
        assert set(errors_of(document)) == {field}, sections
        assert parse_config(document, runnable=False)
    assert set(errors_of({"model": {**moe["model"], "moe": {"gate": "relu"}}})) == {"model.moe.gate"}


def test_dense_first_layers_need_experts_to_follow_and_a_width_tensor_parallelism_splits():
    moe = {"layers": 4, "experts": 4, "top_k": 2}
    deepseek_like = parse_config({"model": {**moe, "moe": {"dense_layers": 3, "dense_ffn": 688}}}).model
    assert [deepseek_like.is_moe_block(index) for index in range(4)] == [False, False, False, True]
    assert deepseek_like.dense_blocks.ffn == 688 and deepseek_like.dense_blocks.experts == 1
    refusals = [
        ({"model": {"moe": {"dense_layers": 1}}}, "model.moe.dense_layers"),
        ({"model": {**moe, "moe": {"dense_layers": 4}}}, "model.moe.dense_layers"),
        ({"model": {**moe, "moe": {"dense_layers": 1, "dense_ffn": 345}}, "parallel": {"tp": 2}}, "parallel.tp"),
    ]
    for document, field in refusals:
        assert set(errors_of(document)) == {field}, document
    assert "moe.dense_ffn=345" in errors_of(refusals[2][0])["parallel.tp"]
