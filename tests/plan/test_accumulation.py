"""Gradient accumulation in the estimate: a global batch of k passes (micro_batch × data-parallel ranks each)
costs k passes of compute, in-layer communication and pipeline bubble, and one gradient reduction; tokens/s
and MFU count the whole global batch."""

import pytest

from trainer.config import ConfigError
from trainer.plan.estimate import estimate

CLUSTER = {"gpu": "H100-SXM", "nodes": 2, "gpus_per_node": 8}
MODEL = {"preset": "llama3-8b", "seq_len": 4096}
MICRO_BATCH = 2
PASSES = 4


def planned(parallel: dict, passes: int, **data):
    """The estimate of `parallel` at a global batch of `passes` × (micro_batch × data-parallel ranks)."""
    dp = parallel.get("dp_replicate", 1) * parallel.get("dp_shard", 1)
    global_batch = passes * MICRO_BATCH * dp if passes > 1 else None
    config = {
        "model": MODEL,
        "parallel": parallel,
        "data": {"micro_batch": MICRO_BATCH, "global_batch": global_batch, **data},
    }
    return estimate(config, CLUSTER, timeline=False)


def term(result, name: str) -> float:
    (value,) = [item.value for item in result.time_terms if item.name == name]
    return value


def dp_traffic(result, op: str):
    """The first pipeline rank's data-parallel collectives of one op, summed: (calls, seconds)."""
    items = [item for item in result.ranks[0].traffic if item.kind == "dp" and item.op == op]
    return sum(item.calls for item in items), sum(item.time_s for item in items)


@pytest.mark.parametrize(
    "parallel",
    [
        {"dp_replicate": 16},  # DDP
        {"dp_shard": 16},  # FSDP
        {"dp_shard": 4, "tp": 2, "pp": 2, "microbatches": 2},  # FSDP under tp and a pipeline
    ],
    ids=["ddp", "fsdp", "fsdp-tp-pp"],
)
def test_a_step_of_four_passes_is_four_passes_of_compute_and_one_gradient_reduction(parallel):
    one, four = planned(parallel, 1), planned(parallel, PASSES)
    assert four.layout.accumulation_steps == PASSES and one.layout.accumulation_steps == 1
    # Every pass's own work scales by the passes.
    assert term(four, "compute") == pytest.approx(PASSES * term(one, "compute"))
    assert term(four, "exposed tp/cp/ep communication") == pytest.approx(
        PASSES * term(one, "exposed tp/cp/ep communication")
    )
    if "pp" in parallel:
        assert term(four, "pipeline bubble") == pytest.approx(PASSES * term(one, "pipeline bubble"))
        assert term(four, "exposed pipeline send/recv") == pytest.approx(
            PASSES * term(one, "exposed pipeline send/recv")
        )
    assert four.hardware_flops_per_step == pytest.approx(PASSES * one.hardware_flops_per_step)
    # The gradient reduction does not: it runs once, in the last pass.
    reduction = "all_reduce" if parallel.get("dp_replicate", 1) > 1 else "reduce_scatter"
    assert dp_traffic(four, reduction) == dp_traffic(one, reduction)
    assert dp_traffic(one, reduction)[0] >= 1
    # The optimizer steps once a step.
    assert term(four, "optimizer step") == term(one, "optimizer step")
    # So a step is four passes and one sync: less than four steps of one pass, more than four passes alone.
    per_pass = sum(term(one, name) for name in ("compute", "exposed tp/cp/ep communication"))
    assert PASSES * per_pass < four.step_s < PASSES * one.step_s
    assert sum(item.value for item in four.time_terms) == pytest.approx(four.step_s)


def test_fsdp_gathers_the_parameters_in_every_pass():
    one, four = planned({"dp_shard": 16}, 1), planned({"dp_shard": 16}, PASSES)
    calls_one, seconds_one = dp_traffic(one, "all_gather")
    calls_four, seconds_four = dp_traffic(four, "all_gather")
    assert calls_four == PASSES * calls_one
    assert seconds_four == pytest.approx(PASSES * seconds_one)


def test_tokens_per_step_and_mfu_count_the_global_batch():
    parallel = {"dp_shard": 16}
    one, four = planned(parallel, 1), planned(parallel, PASSES)
    assert four.layout.global_batch == PASSES * MICRO_BATCH * 16
    assert four.layout.tokens_per_step == four.layout.global_batch * MODEL["seq_len"]
    assert four.model_flops_per_step == pytest.approx(PASSES * one.model_flops_per_step)
    assert four.tokens_per_s == pytest.approx(four.layout.tokens_per_step / four.step_s)
    world_peak = 16 * four.cluster.gpu_type.peak_bf16_flops
    assert four.mfu == pytest.approx(four.model_flops_per_step / (four.step_s * world_peak))
    # Four times the model FLOPs over the longer step: the reduction and optimizer step, once a step, weigh less.
    assert four.mfu / one.mfu == pytest.approx(PASSES * one.step_s / four.step_s)
    assert one.mfu < four.mfu
    layout = four.to_json(timeline=False)["layout"]
    assert (layout["global_batch"], layout["sequences_per_pass"], layout["accumulation_steps"]) == (128, 32, 4)


def memory_terms(result) -> dict[str, float]:
    return {item.name: item.value for item in result.memory[0].terms}


def test_accumulating_under_ddp_holds_no_more_memory_than_one_pass():
    one, four = planned({"dp_replicate": 16}, 1), planned({"dp_replicate": 16}, PASSES)
    assert [rank.reserved_bytes for rank in four.memory] == [rank.reserved_bytes for rank in one.memory]


def test_accumulating_under_fsdp_holds_every_gradient_unsharded_between_passes():
    """Inner passes skip the reduce-scatter, so FSDP2 keeps the whole model's gradients on every rank, in fp32."""
    one, four = memory_terms(planned({"dp_shard": 16}, 1)), memory_terms(planned({"dp_shard": 16}, PASSES))
    assert "FSDP accumulated gradients" not in one and "FSDP unsharded gradients" in one
    assert "FSDP unsharded gradients" not in four
    sharded_gradients = one["gradients"]
    assert four["FSDP accumulated gradients"] == pytest.approx(16 * sharded_gradients, rel=0.02)
    assert {name: value for name, value in four.items() if name != "FSDP accumulated gradients"} == {
        name: value for name, value in one.items() if name != "FSDP unsharded gradients"
    }


def test_a_global_batch_that_passes_do_not_divide_is_refused_by_field():
    with pytest.raises(ConfigError) as refused:
        estimate(
            {"model": MODEL, "parallel": {"dp_shard": 16}, "data": {"micro_batch": 2, "global_batch": 100}}, CLUSTER
        )
    assert "data.global_batch" in refused.value.errors
    assert (
        "multiple of data.micro_batch × data-parallel ranks = 2 × 16 = 32" in refused.value.errors["data.global_batch"]
    )
