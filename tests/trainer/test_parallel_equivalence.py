"""Every layout trains the same model on the same data: in fp32 its per-step losses and final
parameters must match a single process's."""

import copy

import numpy as np
import pytest
import torch

from tests.traffic_agreement import assert_traffic_agrees
from trainer.config import parse_config
from trainer.plan.layout import Layout
from trainer.plan.memory import state_bytes_of_rank
from trainer.plan.traffic import predicted_matrix

from .token_dataset import stdlib_documents, stdlib_token_dataset, write_token_dataset
from .torchrun import FinishedRun, assert_trains_like, run_trainer

pytestmark = pytest.mark.slow

STEPS = 4
GLOBAL_BATCH = 8


def layout(
    micro_batch_divisor: int = 1,
    recompute: str = "none",
    compile: bool = False,
    recompute_every: int = 1,
    accumulation: int = 1,
    **parallel,
) -> dict:
    """A tiny fp32 run whose global batch is GLOBAL_BATCH whatever the data-parallel degree, in `accumulation`
    passes a step."""
    document = {
        "steps": STEPS,
        "model": {"layers": 4, "dim": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "seq_len": 32},
        "parallel": parallel,
        "compute": {
            "precision": "fp32",
            "recompute": recompute,
            "compile": compile,
            "recompute_every": recompute_every,
        },
        "optimizer": {"lr": 3e-3, "warmup_steps": 1},
        "data": {"micro_batch": GLOBAL_BATCH // (micro_batch_divisor * accumulation), "corpus_bytes": 200_000},
        "telemetry": {"flush_interval_s": 0.2, "heartbeat_interval_s": 60},
    }
    if accumulation > 1:
        document["data"]["global_batch"] = GLOBAL_BATCH
    return document


# What every layout is compared with: one process, no parallelism.
REFERENCE = layout()

LAYOUTS = {
    "ddp2": layout(2, dp_replicate=2),
    "fsdp4": layout(4, dp_shard=4),
    "hsdp2x2": layout(4, dp_replicate=2, dp_shard=2),
    "tp2_sp": layout(tp=2),
    "tp2_no_sp": layout(tp=2, sequence_parallel=False, loss_parallel=False),
    "dp2xtp2": layout(2, dp_shard=2, tp=2),
    "pp2_gpipe": layout(pp=2, pp_schedule="GPipe", microbatches=4),
    "pp2_1f1b": layout(pp=2, pp_schedule="1F1B", microbatches=4),
    "pp2_interleaved1f1b": layout(pp=2, pp_schedule="Interleaved1F1B", stages_per_rank=2, microbatches=4),
    "pp2_loopedbfs": layout(pp=2, pp_schedule="LoopedBFS", stages_per_rank=2, microbatches=4),
    "pp2_interleavedzerobubble": layout(pp=2, pp_schedule="InterleavedZeroBubble", stages_per_rank=2, microbatches=4),
    "pp2_zbvzerobubble": layout(pp=2, pp_schedule="ZBVZeroBubble", stages_per_rank=2, microbatches=4),
    "pp2_dualpipev": layout(pp=2, pp_schedule="DualPipeV", stages_per_rank=2, microbatches=4),
    # 4 blocks on 3 stages: the embedding and output count as a block each, so the stages hold 1, 2 and 1.
    "pp3_1f1b_uneven": layout(pp=3, pp_schedule="1F1B", microbatches=4),
    "pp2xdp2xtp2": layout(2, pp=2, dp_shard=2, tp=2, microbatches=2),
    "fsdp2_full_recompute": layout(2, dp_shard=2, recompute="full"),
    "pp2_full_recompute_every_2nd_block": layout(pp=2, recompute="full", recompute_every=2, microbatches=2),
    "tp2_selective_recompute": layout(tp=2, recompute="selective"),
    "fsdp2_compiled_blocks": layout(2, dp_shard=2, compile=True),
    "dp2xtp2_compiled_blocks": layout(2, dp_shard=2, tp=2, compile=True),
    "tp2_full_recompute_compiled": layout(tp=2, recompute="full", compile=True),
    "cp2": layout(cp=2),
    "cp2xdp2": layout(2, cp=2, dp_replicate=2),
    "ddp2xtp2": layout(2, dp_replicate=2, tp=2),
    "ddp2xpp2": layout(2, dp_replicate=2, pp=2, microbatches=2),
    "fsdp2xpp2": layout(2, dp_shard=2, pp=2, microbatches=2),
    "fsdp2xcp2": layout(2, dp_shard=2, cp=2),
    "pp2xtp2": layout(pp=2, tp=2, microbatches=2),
    "pp2xcp2": layout(pp=2, cp=2, microbatches=2),
    "tp2xcp2": layout(tp=2, cp=2),
    "hsdp2x2xtp2": layout(4, dp_replicate=2, dp_shard=2, tp=2),
    "hsdp2x2xpp2": layout(4, dp_replicate=2, dp_shard=2, pp=2, microbatches=2),
    "hsdp2x2xcp2": layout(4, dp_replicate=2, dp_shard=2, cp=2),
    "ddp2xpp2xtp2": layout(2, dp_replicate=2, pp=2, tp=2, microbatches=2),
    "ddp2xpp2xcp2": layout(2, dp_replicate=2, pp=2, cp=2, microbatches=2),
    "ddp2xtp2xcp2": layout(2, dp_replicate=2, tp=2, cp=2),
    "fsdp2xpp2xcp2": layout(2, dp_shard=2, pp=2, cp=2, microbatches=2),
    "fsdp2xtp2xcp2": layout(2, dp_shard=2, tp=2, cp=2),
    "pp2xtp2xcp2": layout(pp=2, tp=2, cp=2, microbatches=2),
}
# Expert parallelism, for mixture-of-experts models only (MODEL_VARIANTS["moe"]): experts split over ep of the
# ranks that shard the model; beside it, experts sharded by FSDP over the rest, replicated across HSDP's replicas,
# context-parallel ranks holding parts of the same sequences, pipeline stages and tensor parallelism splitting each
# expert's columns (test_layout_coverage: every pair of those the validator accepts).
EXPERT_LAYOUTS = {
    "hsdp2x2xcp2_ep2": layout(4, dp_replicate=2, dp_shard=2, cp=2, ep=2),
    "hsdp2x2xpp2_ep2": layout(4, dp_replicate=2, dp_shard=2, pp=2, ep=2, microbatches=2),
    "fsdp2xcp2xpp2_ep2": layout(2, dp_shard=2, cp=2, pp=2, ep=2, microbatches=2),
    "hsdp2x2xtp2_ep2": layout(4, dp_replicate=2, dp_shard=2, tp=2, ep=2),
    "fsdp2xcp2xtp2_ep2": layout(2, dp_shard=2, cp=2, tp=2, ep=2),
}

# ZeRO-1 and 2 on FSDP2 hold the parameters whole through a pass; only gradient accumulation tells them apart
# (ZeRO-1 keeps whole gradients and the gathered parameters from pass to pass, ZeRO-2 reduce-scatters every pass's),
# so each accumulates over two passes, and the data-parallel traffic those choices change is held to the planner's.
# ZeRO-3 joins them under a pipeline, whose inner passes leave the stages' parameters gathered into the next.
ZERO_LAYOUTS = {
    "fsdp2_zero1_accumulate2": layout(2, accumulation=2, dp_shard=2, zero_stage=1),
    "hsdp2x2_zero2_accumulate2": layout(4, accumulation=2, dp_replicate=2, dp_shard=2, zero_stage=2),
    "fsdp2xpp2_zero1_accumulate2": layout(2, accumulation=2, dp_shard=2, pp=2, microbatches=2, zero_stage=1),
    "fsdp2xpp2_zero2_accumulate2": layout(2, accumulation=2, dp_shard=2, pp=2, microbatches=2, zero_stage=2),
    "fsdp2xpp2_zero3_accumulate2": layout(2, accumulation=2, dp_shard=2, pp=2, microbatches=2, zero_stage=3),
}


def assert_planner_predicts_state_bytes(run: FinishedRun, document: dict) -> None:
    """Every rank's parameter, gradient and optimizer-state bytes, as the trainer measured them,
    are what the planner computes for that rank: exactly."""
    planned = Layout(parse_config(document))
    reported = {rank: event["payload"] for rank, event in run.events("metric") if event["step"] == 1}
    assert sorted(reported) == list(range(planned.parallel.world_size))
    for rank, payload in reported.items():
        measured = {key: payload[key] for key in ("parameter_bytes", "gradient_bytes", "optimizer_bytes")}
        assert measured == state_bytes_of_rank(planned, rank), f"rank {rank}"


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    run = run_trainer(tmp_path_factory.mktemp("single"), REFERENCE)
    assert run.returncode == 0, run.output[-4000:]
    assert_planner_predicts_state_bytes(run, REFERENCE)
    return run


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_a_single_process(name, single_process, tmp_path):
    run = run_trainer(tmp_path, LAYOUTS[name])
    assert run.returncode == 0, run.output[-4000:]
    assert_planner_predicts_state_bytes(run, LAYOUTS[name])
    assert len(run.loss_means()) == STEPS
    assert_trains_like(run, single_process)


@pytest.mark.parametrize("name", list(ZERO_LAYOUTS))
def test_zero_layout_matches_a_single_process_and_moves_what_the_planner_predicts(name, single_process, tmp_path):
    document = copy.deepcopy(ZERO_LAYOUTS[name])
    document["telemetry"]["comm_window_steps"] = 1
    run = run_trainer(tmp_path, document)
    assert run.returncode == 0, run.output[-4000:]
    assert_planner_predicts_state_bytes(run, document)
    assert_trains_like(run, single_process)
    # After the first step, whose pipeline shape inference runs one more forward.
    measured = run.traffic_per_step(("dp",), after_step=1, steps=STEPS)["dp"]
    predicted = predicted_matrix(parse_config(document)).by_kind["dp"]
    # Besides the planner's collectives, a step all-reduces a few scalars (loss, gradient norm) over the data ranks.
    assert_traffic_agrees(measured, predicted, slack_bytes=1024)


# The Triton kernels (interpreted on CPU) on the local shards and chunks that tensor, sequence, context and pipeline
# parallelism give them, the loss included, against the single process with torch's ops; FSDP's gathered tensor-
# parallel parameters in pipeline stages (pp2xdp2xtp2) stand for dp2xtp2 and pp2xtp2.
TRITON_LAYOUTS = ["tp2_sp", "tp2_no_sp", "cp2", "pp2_1f1b", "pp2xdp2xtp2"]


@pytest.mark.parametrize("name", TRITON_LAYOUTS)
def test_triton_kernels_train_like_a_single_process_in(name, single_process, tmp_path):
    document = copy.deepcopy(LAYOUTS[name])
    document["compute"]["kernels"] = "triton"
    run = run_trainer(tmp_path, document)
    assert run.returncode == 0, run.output[-4000:]
    assert_trains_like(run, single_process)


# A mixture of experts every layout runs alike: routing ties go to the lower expert, and the balance loss and the
# capacity are counted per sequence, so data parallelism and microbatches leave them as they are. Its first block is
# dense and wider, as DeepSeek-V3's first three are: a pipeline's first stage holds both kinds of block.
MIXTURE = {
    "experts": 4,
    "top_k": 2,
    "moe": {"balance_loss": 0.05, "bias_update_rate": 0.01, "shared_expert": True, "dense_layers": 1, "dense_ffn": 192},
}


# Model variants, each against a single process of its own, in the layouts that touch what they change: GPT-3's
# two-matrix GELU feed-forward block (no w3 for tensor parallelism to split; FSDP; pipeline stages) and tied
# embeddings (one matrix the embedding's and the output's tensor-parallel plans both split over the vocabulary,
# with and without loss parallel; FSDP and DDP holding it once; context parallel; across pipeline stages, a copy on
# the last stage whose gradient the first and the last pipeline rank sum: over the pp group, sharded by FSDP and
# split by tensor parallelism, over a group of their own with more than two pipeline ranks, and on one rank, which
# a V schedule gives both). Parallel blocks (attention and the MLP side by side on one norm, whose output tensor
# parallelism gathers for each of them), dense and as a mixture of experts.
MODEL_VARIANTS = {
    "gelu": {"mlp": "gelu"},
    "tied": {"tie_embeddings": True},
    "moe": MIXTURE,
    "parallel": {"parallel_blocks": True},
    "parallel_moe": MIXTURE | {"parallel_blocks": True},
}
VARIANT_LAYOUTS = [
    ("gelu", "dp2xtp2"),
    ("gelu", "tp2_sp"),
    ("gelu", "pp2_1f1b"),
    ("tied", "dp2xtp2"),
    ("tied", "tp2_no_sp"),
    ("tied", "ddp2"),
    ("tied", "cp2"),
    ("tied", "pp2xdp2xtp2"),
    ("tied", "pp2_zbvzerobubble"),
    ("tied", "pp3_1f1b_uneven"),
    ("moe", "ddp2"),
    ("moe", "pp2_1f1b"),
    ("moe", "tp2_no_sp"),
    ("moe", "pp2xtp2xcp2"),
    # Compiled blocks run their mixture of experts eagerly between the compiled attention and norms.
    ("moe", "dp2xtp2_compiled_blocks"),
    *[("moe", name) for name in EXPERT_LAYOUTS],
    ("parallel", "dp2xtp2"),
    ("parallel", "tp2_no_sp"),
    ("parallel", "cp2"),
    ("parallel", "pp2_1f1b"),
    ("parallel", "dp2xtp2_compiled_blocks"),
    ("parallel_moe", "pp2xtp2xcp2"),
]


def with_model(document: dict, variant: str) -> dict:
    document = copy.deepcopy(document)
    document["model"].update(MODEL_VARIANTS[variant])
    return document


@pytest.fixture(scope="module")
def variant_single_process(tmp_path_factory):
    """The single-process run of a model variant, run once when first asked for."""
    runs: dict[str, FinishedRun] = {}

    def single(variant: str) -> FinishedRun:
        if variant not in runs:
            document = with_model(REFERENCE, variant)
            run = run_trainer(tmp_path_factory.mktemp(f"{variant}-single"), document)
            assert run.returncode == 0, run.output[-4000:]
            assert_planner_predicts_state_bytes(run, document)
            runs[variant] = run
        return runs[variant]

    return single


@pytest.mark.parametrize("variant", list(MODEL_VARIANTS))
def test_a_model_variant_learns_other_losses_than_the_default_model(variant, variant_single_process, single_process):
    assert not np.allclose(variant_single_process(variant).loss_means(), single_process.loss_means(), rtol=1e-3)


@pytest.mark.parametrize(("variant", "name"), VARIANT_LAYOUTS)
def test_a_model_variant_trains_like_its_single_process_in(variant, name, variant_single_process, tmp_path):
    document = with_model(LAYOUTS.get(name) or EXPERT_LAYOUTS[name], variant)
    run = run_trainer(tmp_path, document)
    assert run.returncode == 0, run.output[-4000:]
    assert_planner_predicts_state_bytes(run, document)
    assert_trains_like(run, variant_single_process(variant))
    if variant == "tied":
        # One matrix, or a pipeline's two copies of it updated alike (the gradient norm, compared above, counts it
        # once).
        parameters = run.parameters()
        assert torch.equal(parameters["output.weight"], parameters["embedding.weight"])


# Model variants under the Triton kernels: a parallel block's one norm, on its sequence-parallel shard, feeding a
# selectively recomputed attention and the MLP.
TRITON_VARIANT_LAYOUTS = [("parallel", "tp2_selective_recompute")]


@pytest.mark.parametrize(("variant", "name"), TRITON_VARIANT_LAYOUTS)
def test_triton_kernels_train_a_model_variant_like_its_single_process_in(
    variant, name, variant_single_process, tmp_path
):
    document = with_model(LAYOUTS[name], variant)
    document["compute"]["kernels"] = "triton"
    run = run_trainer(tmp_path, document)
    assert run.returncode == 0, run.output[-4000:]
    assert_trains_like(run, variant_single_process(variant))


def test_bf16_mixed_precision_under_fsdp_tracks_the_fp32_losses(single_process, tmp_path):
    document = layout(2, dp_shard=2)
    document["compute"]["precision"] = "bf16"
    run = run_trainer(tmp_path, document)
    assert run.returncode == 0, run.output[-4000:]
    for want, got in zip(single_process.loss_means(), run.loss_means(), strict=True):
        assert abs(got - want) <= 2e-2 * abs(want)
    # Master weights stay fp32 whatever the compute precision.
    assert {tensor.dtype for tensor in run.parameters().values()} == {torch.float32}


FP8_LAYOUTS = {"fsdp2": layout(2, dp_shard=2), "pp2": layout(pp=2, microbatches=2), "dp2xtp2": LAYOUTS["dp2xtp2"]}


@pytest.mark.parametrize(("name", "scaling"), [("fsdp2", "tensorwise"), ("pp2", "rowwise"), ("dp2xtp2", "rowwise")])
def test_fp8_matmuls_track_the_fp32_losses(name, scaling, single_process, tmp_path):
    """torchao's float8 linear layers in the blocks, under FSDP's bf16 parameters, under a pipeline's autocast and
    on tensor-parallel shards, with both scaling recipes: fp8 rounding moves the losses a little more than bf16
    does, never far."""
    document = copy.deepcopy(FP8_LAYOUTS[name])
    document["compute"] |= {"precision": "fp8", "fp8_scaling": scaling}
    run = run_trainer(tmp_path, document)
    assert run.returncode == 0, run.output[-4000:]
    # 4 blocks of 7 linear layers, converted in the whole model before pipeline stages take their blocks.
    assert f"fp8 matmuls ({scaling} scaling) in 28 linear layers" in run.output
    for want, got in zip(single_process.loss_means(), run.loss_means(), strict=True):
        assert abs(got - want) <= 3e-2 * abs(want)
    assert run.loss_means()[-1] < run.loss_means()[0]
    assert {tensor.dtype for tensor in run.parameters().values()} == {torch.float32}


def test_fp8_matmuls_in_a_mixture_of_experts_track_its_fp32_losses(variant_single_process, tmp_path):
    """Expert and tensor parallelism over FSDP with fp8 attention and shared-expert matmuls; the router and the
    experts' grouped products stay bf16."""
    document = with_model(layout(2, dp_shard=2, tp=2, ep=2), "moe")
    document["compute"] |= {"precision": "fp8", "fp8_scaling": "tensorwise"}
    run = run_trainer(tmp_path, document)
    assert run.returncode == 0, run.output[-4000:]
    # 4 blocks of 4 attention and 3 linear layers: the dense block's, or a shared expert's.
    assert "fp8 matmuls (tensorwise scaling) in 28 linear layers" in run.output
    for want, got in zip(variant_single_process("moe").loss_means(), run.loss_means(), strict=True):
        assert abs(got - want) <= 3e-2 * abs(want)


# On a prepared token dataset, a representative part of the matrix (DDP, FSDP, TP, PP, CP) with validation on:
# every third step and after the last, so steps 3 and 4.
TOKEN_LAYOUTS = {
    "ddp2": {"micro_batch_divisor": 2, "dp_replicate": 2},
    "fsdp2": {"micro_batch_divisor": 2, "dp_shard": 2},
    "tp2_sp": {"tp": 2},
    "pp2_1f1b": {"pp": 2, "pp_schedule": "1F1B", "microbatches": 4},
    "cp2": {"cp": 2},
}
EVAL_STEPS = [3, 4]


def token_layout(dataset, micro_batch_divisor: int = 1, **parallel) -> dict:
    document = layout(micro_batch_divisor, **parallel)
    document["model"]["vocab"] = 320
    document["data"]["dataset"] = str(dataset)
    document["eval"] = {"interval_steps": 3, "batches": 2}
    return document


@pytest.fixture(scope="module")
def token_dataset(tmp_path_factory):
    return stdlib_token_dataset(tmp_path_factory.mktemp("tokens") / "dataset", 200_000, 40_000, shard_tokens=70_000)


@pytest.fixture(scope="module")
def token_single_process(tmp_path_factory, token_dataset):
    run = run_trainer(tmp_path_factory.mktemp("token-single"), token_layout(token_dataset))
    assert run.returncode == 0, run.failure_report()
    return run


@pytest.mark.parametrize("name", list(TOKEN_LAYOUTS))
def test_layout_matches_a_single_process_on_a_token_dataset(name, token_dataset, token_single_process, tmp_path):
    document = token_layout(token_dataset, **TOKEN_LAYOUTS[name])
    run = run_trainer(tmp_path, document)
    assert run.returncode == 0, run.failure_report()
    assert len(run.loss_means()) == STEPS
    assert_trains_like(run, token_single_process)
    (want,) = token_single_process.eval_losses().values()
    assert sorted(want) == EVAL_STEPS
    evaluated = run.eval_losses()
    assert sorted(evaluated) == list(range(parse_config(document).parallel.world_size)), "every rank reports it"
    for rank, got in evaluated.items():
        assert sorted(got) == EVAL_STEPS
        for step in EVAL_STEPS:
            assert abs(got[step] - want[step]) <= 1e-5 * want[step], f"rank {rank} step {step}"
            assert got[step] == evaluated[0][step], "the same value on every rank"


# data.document_mask: attention kept within documents, in the layouts that take it (pp and cp refuse it).
MASKED_LAYOUTS = {
    "ddp2": {"micro_batch_divisor": 2, "dp_replicate": 2},
    "fsdp2": {"micro_batch_divisor": 2, "dp_shard": 2},
    "tp2_sp": {"tp": 2},
    "fsdp2_selective_recompute": {"micro_batch_divisor": 2, "dp_shard": 2, "recompute": "selective"},
}


def masked_layout(dataset, document_mask: bool = True, **parallel) -> dict:
    document = token_layout(dataset, **parallel)
    document["data"]["document_mask"] = document_mask
    return document


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """Documents of 10 to 40 bytes, so most 33-token windows cross an end-of-text token."""
    stream = np.concatenate(stdlib_documents(60_000))
    cuts = np.cumsum(np.random.default_rng(0).integers(10, 40, size=len(stream) // 10))
    documents = np.split(stream, cuts[cuts < len(stream)])
    directory = tmp_path_factory.mktemp("short") / "dataset"
    return write_token_dataset(directory, {"train": documents[:-200], "validation": documents[-200:]}, 20_000)


@pytest.fixture(scope="module")
def masked_single_process(tmp_path_factory, short_documents):
    run = run_trainer(tmp_path_factory.mktemp("masked-single"), masked_layout(short_documents))
    assert run.returncode == 0, run.failure_report()
    return run


def test_the_document_mask_changes_what_a_single_process_learns(masked_single_process, short_documents, tmp_path):
    unmasked = run_trainer(tmp_path, masked_layout(short_documents, document_mask=False))
    assert unmasked.returncode == 0, unmasked.failure_report()
    assert unmasked.loss_means()[0] != masked_single_process.loss_means()[0]


@pytest.mark.parametrize("name", list(MASKED_LAYOUTS))
def test_a_document_masked_layout_matches_a_single_process(name, short_documents, masked_single_process, tmp_path):
    run = run_trainer(tmp_path, masked_layout(short_documents, **MASKED_LAYOUTS[name]))
    assert run.returncode == 0, run.failure_report()
    assert_trains_like(run, masked_single_process)
