"""Every kind of layout the validator lets the trainer run is in the equivalence matrix.

A layout's kind is which of dp_replicate, dp_shard, tp, pp and cp are above 1, and the
data-parallel path the trainer takes for it (ParallelConfig.data_parallel_path: DDP, FSDP, HSDP or
none). Two layouts of one kind run the same code: parallelize() branches on whether a dim is above 1
and on that path, never on a degree, so dp_shard=4 runs what dp_shard=2 runs on more ranks, and one
layout with degree 2 in each of its dims stands for all of its kind. The kind with no dim above 1
is the single process every layout of the matrix is compared with (REFERENCE). Pipeline schedules,
sequence parallelism, recompute and compile are choices within a kind; the matrix names its own
layouts for those.
"""

import itertools
import math

from trainer.config import ConfigError, ParallelConfig, parse_config

from .test_parallel_equivalence import (
    EXPERT_LAYOUTS,
    LAYOUTS,
    MODEL_VARIANTS,
    REFERENCE,
    VARIANT_LAYOUTS,
    ZERO_LAYOUTS,
    with_model,
)

DIMS = ("dp_replicate", "dp_shard", "tp", "pp", "cp")
DEGREES = (1, 2, 4, 8)
MAX_WORLD_SIZE = 8
# The equivalence test's run on a model every degree up to 8 divides: layers (pp), heads and
# kv_heads (tp); its seq_len 32 takes 2 × cp × tp ≤ 16 sequence chunks.
ROOMY_MODEL = {**REFERENCE["model"], "layers": 8, "heads": 8, "kv_heads": 8}


def kind(parallel: ParallelConfig) -> tuple[tuple[str, ...], str]:
    return tuple(dim for dim in DIMS if getattr(parallel, dim) > 1), parallel.data_parallel_path


def runnable_layouts() -> list[ParallelConfig]:
    """Every combination of degrees on at most MAX_WORLD_SIZE ranks that parse_config accepts as
    runnable (the rules the API, the designer and the planner's --runnable-only search apply)."""
    accepted = []
    for degrees in itertools.product(DEGREES, repeat=len(DIMS)):
        if math.prod(degrees) > MAX_WORLD_SIZE:
            continue
        parallel = dict(zip(DIMS, degrees, strict=True))
        if parallel["pp"] > 1:
            parallel["microbatches"] = parallel["pp"]
        document = {**REFERENCE, "model": ROOMY_MODEL, "parallel": parallel}
        try:
            accepted.append(parse_config(document).parallel)
        except ConfigError:
            continue
    return accepted


def test_every_runnable_kind_of_layout_has_a_layout_in_the_equivalence_matrix():
    covered = {kind(parse_config(document).parallel) for document in [REFERENCE, *LAYOUTS.values()]}
    runnable = runnable_layouts()
    # Every degree of every dim is among them: the rules did not refuse all but a handful.
    assert {(dim, getattr(parallel, dim)) for parallel in runnable for dim in DIMS} == {
        (dim, degree) for dim in DIMS for degree in DEGREES
    }
    missing = sorted({kind(parallel) for parallel in runnable} - covered)
    assert not missing, f"kinds of layout the trainer runs that no equivalence layout covers: {missing}"


# A mixture-of-experts layout adds its own branches to the dense ones: expert parallelism, experts sharded by FSDP
# beyond it or replicated across HSDP's replicas, context parallelism adding up a sequence's routing totals,
# pipeline stages keeping their shape inference out of the expert load and tensor parallelism splitting the experts'
# columns (routing each rank's part of the sequences, with or without sequence parallelism). Each is a hook of its
# own, so the matrix covers every pair of them (and of the data-parallel path) that the validator accepts together.
MOE_MODEL = {**ROOMY_MODEL, **MODEL_VARIANTS["moe"], "experts": 8}


def moe_features(parallel: ParallelConfig) -> frozenset[str]:
    experts_split = parallel.ep > 1
    features = {
        "ep": experts_split,
        "experts sharded": experts_split and parallel.sharding_ranks > parallel.ep,
        "experts replicated": experts_split and parallel.dp_replicate > 1,
        "cp": parallel.cp > 1,
        "pp": parallel.pp > 1,
        "tp": parallel.tp > 1,
    }
    return frozenset({name for name, present in features.items() if present} | {parallel.data_parallel_path})


def runnable_moe_layouts() -> list[ParallelConfig]:
    dims = ("dp_replicate", "dp_shard", "pp", "cp", "tp", "ep")
    accepted = []
    for degrees, sequence_parallel in itertools.product(itertools.product(DEGREES, repeat=len(dims)), (True, False)):
        parallel = dict(zip(dims, degrees, strict=True), sequence_parallel=sequence_parallel)
        if math.prod(degrees[:-1]) > MAX_WORLD_SIZE:
            continue
        if parallel["pp"] > 1:
            parallel["microbatches"] = parallel["pp"]
        try:
            accepted.append(parse_config({**REFERENCE, "model": MOE_MODEL, "parallel": parallel}).parallel)
        except ConfigError:
            continue
    return accepted


def test_every_pair_of_mixture_of_experts_branches_the_trainer_runs_is_in_the_equivalence_matrix():
    layouts = [REFERENCE] + [
        LAYOUTS.get(name) or EXPERT_LAYOUTS[name] for variant, name in VARIANT_LAYOUTS if variant == "moe"
    ]
    covered = [moe_features(parse_config(with_model(document, "moe")).parallel) for document in layouts]
    runnable = runnable_moe_layouts()
    assert any(parallel.ep == 8 for parallel in runnable)
    pairs = {
        frozenset(pair)
        for parallel in runnable
        for pair in itertools.combinations_with_replacement(moe_features(parallel), 2)
    }
    missing = sorted(sorted(pair) for pair in pairs if not any(pair <= features for features in covered))
    assert not missing, (
        f"pairs of mixture-of-experts branches the trainer runs that no equivalence layout covers: {missing}"
    )


# ZeRO-1 and 2 branch where gradient accumulation and pipeline schedules reduce (accumulation_pass,
# gradients_reduced), so the matrix runs each with and without pipeline stages, accumulating over passes.
def test_zero_1_and_2_run_in_the_matrix_with_and_without_pipeline_stages_and_accumulating():
    configs = [parse_config(document) for document in ZERO_LAYOUTS.values()]
    assert all(config.accumulation_steps > 1 for config in configs)
    covered = {(config.parallel.zero, config.parallel.pp > 1) for config in configs}
    assert covered >= {(zero, staged) for zero in (1, 2) for staged in (False, True)}


def test_a_mixture_of_experts_runs_in_the_matrix_under_tensor_parallelism_with_and_without_sequence_parallel():
    tensor_parallel = [
        parse_config(with_model(LAYOUTS.get(name) or EXPERT_LAYOUTS[name], "moe")).parallel
        for variant, name in VARIANT_LAYOUTS
        if variant == "moe"
    ]
    assert {parallel.sequence_parallel for parallel in tensor_parallel if parallel.tp > 1} == {True, False}
