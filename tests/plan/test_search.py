"""The layout search: it finds what fits, ranks it as the estimate would, keeps the true Pareto
frontier, prunes only what provably cannot matter, and says why when nothing fits."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import PIPELINE_SCHEDULES, ConfigError, divisors, parse_config
from trainer.pipeline_split import stage_block_counts
from trainer.plan.estimate import estimate, estimate_layout
from trainer.plan.layout import Layout
from trainer.plan.presets import MODEL_PRESETS
from trainer.plan.schedule import check_schedule
from trainer.plan.search import (
    RECOMPUTE_LEANEST_FIRST,
    Candidate,
    DataChoice,
    PipelineChoice,
    SearchSpace,
    search,
    summarize,
)

REPO = Path(__file__).resolve().parents[2]
H100_64 = {"gpu": "H100-SXM", "nodes": 8, "gpus_per_node": 8}
# Small enough that the estimate of every layout takes milliseconds, big enough that some do not fit.
SMALL_CASES = [
    ({"preset": "llama3-8b", "layers": 4}, {"gpu": "A100-40GB", "nodes": 1, "gpus_per_node": 4}, 8),
    ({"preset": "mixtral-8x7b", "layers": 2}, {"gpu": "A100-40GB", "nodes": 1, "gpus_per_node": 4}, 8),
    # DeepSeek-V3's shape: a wider dense block first, then mixtures of experts; pipeline stages hold either or both.
    (
        {"preset": "mixtral-8x7b", "layers": 3, "moe": {"dense_layers": 1, "dense_ffn": 28672}},
        {"gpu": "A100-40GB", "nodes": 1, "gpus_per_node": 4},
        8,
    ),
    ({"preset": "llama3-8b", "layers": 4, "seq_len": 4096}, {"gpu": "A100-40GB", "nodes": 2, "gpus_per_node": 2}, 8),
]


@pytest.fixture(scope="module")
def llama70b():
    return search({"preset": "llama3-70b"}, H100_64, 512)


def test_llama3_70b_on_64_h100s_fits_with_layouts_the_rules_accept(llama70b):
    assert llama70b.fitting > 0 and llama70b.results and llama70b.message is None
    for found in llama70b.results + llama70b.pareto:
        config = parse_config(found.config.model_dump(mode="json"), runnable=False)
        parallel = config.parallel
        assert parallel.world_size == 64
        assert config.data.micro_batch * parallel.data_parallel == 512
        assert parallel.sequence_parallel == (parallel.tp > 1)
        assert found.peak_bytes <= 80 * 2**30


def test_results_are_the_fastest_first(llama70b):
    speeds = [found.tokens_per_s for found in llama70b.results]
    assert speeds == sorted(speeds, reverse=True)
    assert len(speeds) == 20


def test_every_figure_is_the_estimate_of_the_returned_config(llama70b):
    for found in llama70b.results + llama70b.pareto:
        result = estimate(found.config.model_dump(mode="json"), H100_64, timeline=False)
        assert result.fits
        assert found.tokens_per_s == pytest.approx(result.tokens_per_s, rel=1e-9)
        assert found.mfu == pytest.approx(result.mfu, rel=1e-9)
        assert found.step_s == pytest.approx(result.step_s, rel=1e-9)
        assert found.peak_bytes == pytest.approx(result.peak.reserved_bytes, rel=1e-9)
        assert found.bubble_fraction == pytest.approx(result.bubble_fraction, rel=1e-9, abs=1e-12)


def test_the_pareto_frontier_is_non_dominated_and_covers_every_result(llama70b):
    front = llama70b.pareto
    assert [f.peak_bytes for f in front] == sorted(f.peak_bytes for f in front)
    assert all(later.tokens_per_s > earlier.tokens_per_s for earlier, later in itertools.pairwise(front))
    assert front[-1].tokens_per_s == llama70b.results[0].tokens_per_s
    for found in llama70b.results:
        assert any(point.peak_bytes <= found.peak_bytes and point.tokens_per_s >= found.tokens_per_s for point in front)


def test_json_is_the_documented_shape(llama70b):
    document = json.loads(json.dumps(llama70b.to_json()))
    assert set(document) == {"evaluated", "valid", "fitting", "timed", "seconds", "message", "results", "pareto"}
    assert document["evaluated"] >= document["valid"] >= document["fitting"] >= document["timed"] > 0
    entry_keys = {
        "rank",
        "config",
        "summary",
        "runnable",
        "tokens_per_s",
        "mfu",
        "step_s",
        "peak_bytes",
        "bubble_fraction",
    }
    assert [entry["rank"] for entry in document["results"]] == list(range(1, 21))
    for entry in document["results"] + document["pareto"]:
        assert set(entry) == entry_keys
        assert set(entry["config"]) >= {"model", "parallel", "compute", "data", "optimizer"}
    ranked = {entry["summary"]: entry["rank"] for entry in document["results"]}
    for entry in document["pareto"]:
        assert entry["rank"] == ranked.get(entry["summary"])


def test_the_trainer_runs_every_zero_stage_the_search_ranks(llama70b):
    found = llama70b.results + llama70b.pareto
    assert {entry.candidate.data.zero_stage for entry in found} == {1, 2, 3}
    assert all(entry.runnable for entry in found)


def test_llama3_405b_on_16384_h100s_finds_layouts_that_split_its_126_layers():
    result = search({"preset": "llama3-405b"}, {"gpu": "H100-SXM", "nodes": 2048}, 2048)
    assert result.results
    uneven = 0
    for found in result.results + result.pareto:
        parallel = found.config.parallel
        assert parallel.world_size == 16384
        stages = parallel.pp * parallel.stages_per_rank
        counts = stage_block_counts(126, stages)
        assert sum(counts) == 126 and min(counts) >= 1
        uneven += 126 % stages != 0
    # 16 stages of 7, 8, …, 8, 7 blocks, as Llama 3.1 405B trained, are among the layouts it may rank.
    assert uneven > 0


@pytest.mark.parametrize(("model", "cluster", "global_batch"), SMALL_CASES)
def test_the_pruned_search_equals_timing_every_layout(model, cluster, global_batch):
    """Every valid layout estimated in full: the same counts, the same fastest, the same frontier."""
    space = SearchSpace.parse(model, cluster, global_batch, None, "bf16", 20, None)
    timed = []
    for tp, cp, pp, dp, micro_batch in space.layouts_of_world():
        _, data = space.data_choices(tp, cp, dp)
        _, pipelines = space.pipeline_choices(pp, micro_batch)
        for (schedule, stages_per_rank), counts in pipelines.items():
            for microbatches, choice, recompute in itertools.product(counts, data, RECOMPUTE_LEANEST_FIRST):
                candidate = Candidate(
                    tp, cp, pp, PipelineChoice(schedule, stages_per_rank, microbatches), choice, recompute, micro_batch
                )
                config = parse_config(space.config(candidate).model_dump(mode="json"), runnable=False)
                timed.append(estimate_layout(Layout(config), space.cluster, timeline=False))
    fitting = [each for each in timed if each.fits]
    result = search(model, cluster, global_batch)
    assert (result.valid, result.fitting) == (len(timed), len(fitting))
    assert 0 < len(fitting) < len(timed)
    fastest = sorted((each.tokens_per_s for each in fitting), reverse=True)[:20]
    assert [found.tokens_per_s for found in result.results] == pytest.approx(fastest, rel=1e-9)
    front = []
    for each in sorted(fitting, key=lambda each: (each.peak.reserved_bytes, -each.tokens_per_s)):
        if not front or each.tokens_per_s > front[-1][1]:
            front.append((each.peak.reserved_bytes, each.tokens_per_s))
    found = [value for point in result.pareto for value in (point.peak_bytes, point.tokens_per_s)]
    assert found == pytest.approx([value for point in front for value in point], rel=1e-9)


def test_every_layout_the_rules_accept_is_searched():
    """Layouts built and validated whole, independently of the search's part-by-part checks."""
    model, cluster, global_batch = SMALL_CASES[0]
    config = parse_config({"model": {**MODEL_PRESETS["llama3-8b"], "layers": 4}}, runnable=False)
    gpus, layers = 4, config.model.layers
    valid = 0
    for tp, cp, pp in itertools.product(divisors(gpus), repeat=3):
        if gpus % (tp * cp * pp) or global_batch % (gpus // (tp * cp * pp)):
            continue
        dp = gpus // (tp * cp * pp)
        micro_batch = global_batch // dp
        pipelines = (
            [("1F1B", 1, 1)]
            if pp == 1
            else itertools.product(
                PIPELINE_SCHEDULES,
                range(1, layers + 1),
                divisors(micro_batch),
            )
        )
        for (schedule, stages, microbatches), shard, (zero, reshard) in itertools.product(
            pipelines, divisors(dp), [(0, True), (1, True), (2, True), (3, True), (3, False)]
        ):
            parallel = {
                "tp": tp,
                "sequence_parallel": tp > 1,
                "cp": cp,
                "pp": pp,
                "pp_schedule": schedule,
                "stages_per_rank": stages,
                "microbatches": microbatches,
                "dp_replicate": dp // shard,
                "dp_shard": shard,
                "zero_stage": zero,
                "reshard_after_forward": reshard,
            }
            document = {"model": config.model.model_dump(), "parallel": parallel, "data": {"micro_batch": micro_batch}}
            try:
                parse_config(document, runnable=False)
            except ConfigError:
                continue
            valid += 1
    assert search(model, cluster, global_batch).valid == valid * len(RECOMPUTE_LEANEST_FIRST)


# ---- only the layouts loom's trainer runs ----

# The trainer runs a mixture of experts without tensor parallelism only, so the search ranks some layouts it cannot.
MIXTURE_CASES = [case for case in SMALL_CASES if "mixtral" in case[0]["preset"]]


@pytest.mark.parametrize(("model", "cluster", "global_batch"), SMALL_CASES)
def test_a_runnable_only_search_returns_only_what_a_launch_accepts(model, cluster, global_batch):
    result = search(model, cluster, global_batch, runnable_only=True)
    assert result.results and result.pareto
    for found in result.results + result.pareto:
        parse_config(found.config.model_dump(mode="json"))
        assert found.runnable


@pytest.mark.parametrize(("model", "cluster", "global_batch"), MIXTURE_CASES)
def test_the_best_runnable_layout_is_the_best_runnable_one_of_the_full_ranking(model, cluster, global_batch):
    every_fitting = search(model, cluster, global_batch).fitting
    ranking = [found for found in search(model, cluster, global_batch, limit=every_fitting).results if found.runnable]
    assert len(ranking) < every_fitting, "the unrestricted search must rank layouts the trainer cannot run"
    best = search(model, cluster, global_batch, runnable_only=True).results[0]
    assert best.summary == ranking[0].summary
    assert best.tokens_per_s == pytest.approx(ranking[0].tokens_per_s, rel=1e-12)


def test_a_runnable_only_search_ranks_tied_embeddings_across_pipeline_stages():
    # GPT-3's shape (GELU blocks, tied embeddings), cut to 8 layers: the trainer keeps the last stage's copy of the
    # embedding in step with the first stage's.
    model = {"preset": "gpt3-175b", "layers": 8, "dim": 1024, "heads": 16, "kv_heads": 16, "ffn": 4096}
    cluster = {"gpu": "H100-SXM", "nodes": 1, "gpus_per_node": 8}
    runnable = search(model, cluster, 16, limit=1000, runnable_only=True)
    assert any(found.config.parallel.pp > 1 for found in runnable.results)
    # The stages' all-reduce of the tied gradients is sized by how the data-parallel split shards them.
    for found in runnable.results + runnable.pareto:
        result = estimate(found.config.model_dump(mode="json"), cluster, timeline=False)
        assert found.step_s == pytest.approx(result.step_s, rel=1e-9), found.summary


def test_a_runnable_only_search_of_a_mixture_of_experts_keeps_to_what_the_trainer_runs_of_it():
    model = {"preset": "mixtral-8x7b", "layers": 2}
    cluster = {"gpu": "H100-SXM", "nodes": 1, "gpus_per_node": 4}
    every = search(model, cluster, 8, limit=1000)
    # Expert parallelism the trainer cannot place: over replicas, not within the ranks that shard the model.
    assert any(found.config.parallel.sharding_ranks % found.config.parallel.ep for found in every.results)
    runnable = search(model, cluster, 8, limit=1000, runnable_only=True)
    layouts = [found.config.parallel for found in runnable.results + runnable.pareto]
    assert any(parallel.ep > 1 and parallel.tp > 1 for parallel in layouts)
    assert all(parallel.sharding_ranks % parallel.ep == 0 for parallel in layouts)


# ---- what the pruning relies on, checked against the estimate itself ----

PROPERTY_MODEL = {"preset": "llama3-8b", "layers": 8, "seq_len": 4096}
PIPELINES = [
    ("1F1B", 1),
    ("GPipe", 1),
    ("Interleaved1F1B", 2),
    ("InterleavedZeroBubble", 2),
    ("LoopedBFS", 2),
    ("ZBVZeroBubble", 2),
    ("DualPipeV", 2),
]


def layout_of(parallel: dict, micro_batch: int, recompute: str) -> Layout:
    document = {
        "model": {**MODEL_PRESETS["llama3-8b"], "layers": 8, "seq_len": 4096},
        "parallel": parallel,
        "data": {"micro_batch": micro_batch},
        "compute": {"precision": "bf16", "recompute": recompute},
    }
    return Layout(parse_config(document, runnable=False))


def estimates_along(parallel: dict, micro_batch: int, recompute: str, microbatch_counts: list[int]):
    cluster = SearchSpace.parse(PROPERTY_MODEL, {"nodes": 2}, 32, None, "bf16", 1, None).cluster
    for microbatches in microbatch_counts:
        layout = layout_of({**parallel, "microbatches": microbatches}, micro_batch, recompute)
        yield estimate_layout(layout, cluster, timeline=False)


@pytest.mark.parametrize(("schedule", "stages_per_rank"), PIPELINES)
@pytest.mark.parametrize("data", [{"dp_shard": 2}, {"dp_replicate": 2}, {"dp_shard": 2, "zero_stage": 1}])
def test_memory_never_grows_with_more_microbatches_or_more_recompute(schedule, stages_per_rank, data):
    parallel = {"tp": 2, "pp": 2, "cp": 2, "pp_schedule": schedule, "stages_per_rank": stages_per_rank, **data}
    by_mode = {}
    for recompute in RECOMPUTE_LEANEST_FIRST:
        counts = [m for m in (32, 16, 8, 4) if _schedule_runs(schedule, 2, m, stages_per_rank)]
        peaks = [each.peak.reserved_bytes for each in estimates_along(parallel, 32, recompute, counts)]
        assert peaks == sorted(peaks), (recompute, counts, peaks)
        by_mode[recompute] = peaks
    assert by_mode["full"] <= by_mode["selective"] <= by_mode["none"]


@pytest.mark.parametrize(("schedule", "stages_per_rank"), PIPELINES)
@pytest.mark.parametrize("recompute", RECOMPUTE_LEANEST_FIRST)
def test_in_layer_communication_never_shrinks_with_more_microbatches(schedule, stages_per_rank, recompute):
    parallel = {"tp": 2, "pp": 2, "cp": 2, "dp_shard": 2, "pp_schedule": schedule, "stages_per_rank": stages_per_rank}
    counts = [m for m in (4, 8, 16, 32) if _schedule_runs(schedule, 2, m, stages_per_rank)]
    exposed = [
        max(rank.exposed(("tp", "cp", "ep")) for rank in each.ranks)
        for each in estimates_along(parallel, 32, recompute, counts)
    ]
    assert exposed == sorted(exposed)


@pytest.mark.parametrize("recompute", RECOMPUTE_LEANEST_FIRST)
def test_activations_and_flops_scale_with_the_sequences_in_a_microbatch(recompute):
    """The activations the search computes for one sequence and multiplies by the micro-batch size
    (FLOPs scale alike)."""
    from trainer.plan.memory import activation_terms, pipeline_buffer_term
    from trainer.plan.terms import total

    def per_rank(micro_batch: int):
        layout = layout_of({"tp": 2, "pp": 2, "microbatches": 2, "pp_schedule": "1F1B"}, micro_batch, recompute)
        memory = [total(activation_terms(layout, rank) + pipeline_buffer_term(layout)) for rank in range(2)]
        cluster = SearchSpace.parse(PROPERTY_MODEL, {"nodes": 2}, 32, None, "bf16", 1, None).cluster
        flops = [rank.compute.forward_flops for rank in estimate_layout(layout, cluster, timeline=False).ranks]
        return memory + flops

    one, six = per_rank(2), per_rank(12)
    assert six == pytest.approx([6 * value for value in one], rel=1e-12)


def _schedule_runs(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> bool:
    try:
        check_schedule(schedule, pp, microbatches, stages_per_rank)
    except ValueError:
        return False
    return True


# ---- when nothing fits, and bad input ----


def test_a_model_too_big_for_the_cluster_returns_nothing_and_says_why():
    result = search({"preset": "llama3-405b"}, {"gpu": "H100-SXM", "nodes": 1}, 8)
    assert result.results == [] and result.pareto == [] and result.fitting == 0
    assert result.valid > 0
    assert "none of the" in result.message and "fits in 79.6 GiB" in result.message and "leanest" in result.message
    assert result.to_json()["message"] == result.message


def test_a_batch_no_layout_can_split_says_so():
    # One layer, one key/value head, 8 tokens: at most 4 GPUs besides data parallelism, which 3 cannot fill.
    model = {"layers": 1, "dim": 64, "heads": 4, "kv_heads": 1, "ffn": 172, "vocab": 256, "seq_len": 8}
    result = search(model, {"nodes": 2, "gpus_per_node": 8}, 3)
    assert result.valid == 0 and result.results == []
    assert "no layout" in result.message


@pytest.mark.parametrize(
    ("arguments", "options", "field"),
    [
        (({"preset": "llama3-70b"}, H100_64, 0), {}, "global_batch"),
        (({"preset": "llama3-70b"}, H100_64, "512"), {}, "global_batch"),
        (({"preset": "llama3-70b"}, H100_64, 512), {"limit": 0}, "limit"),
        (({"preset": "llama3-70b"}, H100_64, 512), {"seq_len": -1}, "seq_len"),
        (({"preset": "llama3-70b"}, H100_64, 512), {"seq_len": 2**21}, "model.seq_len"),
        (({"preset": "llama3-70b"}, H100_64, 512), {"precision": "fp16"}, "precision"),
        (({"preset": "llama3-70b"}, H100_64, 512), {"gpus": 65}, "gpus"),
        (({"preset": "llama3-70b"}, H100_64, 512), {"runnable_only": "yes"}, "runnable_only"),
        (({"preset": "gpt-5"}, H100_64, 512), {}, "model.preset"),
        (({"layers": 0}, H100_64, 512), {}, "model.layers"),
        (("llama3-70b", H100_64, 512), {}, "model"),
        (({"preset": "llama3-70b"}, {"nodes": 0}, 512), {}, "cluster.nodes"),
        (({"preset": "llama3-70b"}, {"gpu": "TPU"}, 512), {}, "cluster.gpu"),
        (({"preset": "llama3-70b"}, {"gpu": "A100-80GB"}, 512), {"precision": "fp8"}, "precision"),
    ],
)
def test_bad_input_is_refused_field_by_field(arguments, options, field):
    with pytest.raises(ConfigError) as refused:
        search(*arguments, **options)
    assert field in refused.value.errors


def test_every_bad_field_is_named_at_once():
    with pytest.raises(ConfigError) as refused:
        search({"preset": "llama3-70b", "heads": 7}, {"nodes": 0}, 0)
    assert {"global_batch", "model.heads", "cluster.nodes"} <= set(refused.value.errors)


def test_a_part_of_the_cluster_can_be_searched():
    result = search({"preset": "llama3-8b"}, H100_64, 64, gpus=16, limit=3)
    assert len(result.results) == 3
    assert all(found.config.parallel.world_size == 16 for found in result.results + result.pareto)


def test_a_summary_names_every_choice_that_is_not_the_default():
    interleaved = Candidate(
        8, 1, 4, PipelineChoice("Interleaved1F1B", 2, 8), DataChoice(1, 2, 3, 1, True), "selective", 32
    )
    assert summarize(interleaved) == "tp8 pp4 Interleaved1F1B×2 m8 dp_shard2 selective"
    hybrid = Candidate(4, 2, 1, PipelineChoice("1F1B", 1, 1), DataChoice(2, 4, 3, 1, False), "none", 4)
    assert summarize(hybrid) == "tp4 cp2 dp_replicate2 dp_shard4 no-reshard"
    zero = Candidate(1, 1, 1, PipelineChoice("1F1B", 1, 1), DataChoice(1, 8, 1, 1, True), "full", 1)
    assert summarize(zero) == "tp1 dp_shard8 zero1 full"


def test_the_search_and_the_exporters_import_without_torch():
    code = "import sys, trainer.plan.search, trainer.plan.export, trainer.plan.__main__; print('torch' in sys.modules)"
    answer = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.strip() == "False"
