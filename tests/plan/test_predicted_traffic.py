"""The planner's predicted traffic matrix against the one a real pp2 × dp2 × tp2 run measures."""

import pytest

from tests.hybrid import hybrid_config
from tests.traffic_agreement import assert_traffic_agrees, talking
from tests.trainer.torchrun import run_trainer
from trainer.config import parse_config
from trainer.plan.traffic import predicted_matrix

pytestmark = pytest.mark.slow

STEPS = 3
HYBRID_RUN = hybrid_config(STEPS, comm_window_steps=1)
KINDS = ("tp", "dp", "pp")


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """The traffic of the steps after the first, per step. The first also runs the pipeline's shape
    inference (one extra forward) and is left out: the planner predicts a steady-state step."""
    run = run_trainer(tmp_path_factory.mktemp("hybrid"), HYBRID_RUN)
    assert run.returncode == 0, run.output[-4000:]
    assert len([event for _, event in run.events("comm") if event["payload"]["window"][0] > 1]) == 8 * (STEPS - 1)
    return run.traffic_per_step(KINDS, after_step=1, steps=STEPS)


@pytest.fixture(scope="module")
def predicted():
    return predicted_matrix(parse_config(HYBRID_RUN)).by_kind


@pytest.mark.parametrize("kind", KINDS)
def test_the_same_pairs_talk(kind, measured, predicted):
    assert talking(predicted[kind]) == talking(measured[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_volumes_agree_within_ten_percent(kind, measured, predicted):
    assert_traffic_agrees(measured[kind], predicted[kind])


# Tied embeddings across the two stages: besides the sends, the first and the last pipeline rank all-reduce their
# copies' gradients once a step, each rank its FSDP shard of its tensor-parallel rows of the matrix.
TIED_RUN = {**HYBRID_RUN, "model": {**HYBRID_RUN["model"], "tie_embeddings": True}}


@pytest.fixture(scope="module")
def measured_tied(tmp_path_factory):
    run = run_trainer(tmp_path_factory.mktemp("tied"), TIED_RUN)
    assert run.returncode == 0, run.output[-4000:]
    return run.traffic_per_step(KINDS, after_step=1, steps=STEPS)


def test_a_tied_pipelines_traffic_is_what_the_planner_predicts(measured_tied, measured, predicted):
    tied = predicted_matrix(parse_config(TIED_RUN)).by_kind
    for kind in KINDS:
        assert_traffic_agrees(measured_tied[kind], tied[kind])
    # What the tie adds on its own: the all-reduce between the ranks that send each other activations.
    pipeline_pairs = talking(tied["pp"])
    assert len(pipeline_pairs) == 8
    for source, destination in pipeline_pairs:
        added = measured_tied["pp"][source][destination] - measured["pp"][source][destination]
        expected = tied["pp"][source][destination] - predicted["pp"][source][destination]
        assert expected > 0 and abs(added - expected) <= 0.1 * expected, (source, destination, added, expected)


def test_without_a_cluster_ranks_fill_nodes_of_the_default_size_and_bytes_do_not_change():
    from trainer.plan.hardware import ClusterSpec
    from trainer.plan.traffic import predicted_rows

    config = parse_config({**HYBRID_RUN, "parallel": {"tp": 2, "dp_replicate": 64}}, runnable=False)
    rows = predicted_rows(config)  # 128 ranks: more than one node may hold
    assert len(rows) == 128
    assert rows == predicted_rows(config, ClusterSpec(nodes=16, gpus_per_node=8))


# Expert parallelism's all-to-alls: a mixture of experts on dp_shard 4 with ep 2, so the ep pairs are not the FSDP
# group, and FSDP shards each rank's experts over the other pair. What crosses in the all-to-alls depends on where
# the router sends tokens; the balance loss keeps it near the planner's even split.
EXPERT_RUN = {
    **HYBRID_RUN,
    "model": {**HYBRID_RUN["model"], "experts": 4, "top_k": 2, "moe": {"balance_loss": 0.05}},
    "parallel": {"dp_shard": 4, "ep": 2},
}


@pytest.fixture(scope="module")
def measured_expert_traffic(tmp_path_factory):
    run = run_trainer(tmp_path_factory.mktemp("experts"), EXPERT_RUN)
    assert run.returncode == 0, run.output[-4000:]
    return run.traffic_per_step(("ep", "dp"), after_step=1, steps=STEPS)


@pytest.mark.parametrize(
    ("kind", "pairs"),
    [
        ("ep", {(0, 1), (1, 0), (2, 3), (3, 2)}),
        # FSDP's ring over all four ranks for the rest of the model, and over 0, 2 and 1, 3 for the experts.
        ("dp", {(0, 1), (1, 2), (2, 3), (3, 0), (0, 2), (2, 0), (1, 3), (3, 1)}),
    ],
)
def test_an_expert_parallel_runs_traffic_is_what_the_planner_predicts(kind, pairs, measured_expert_traffic):
    measured = measured_expert_traffic[kind]
    assert talking(measured) == pairs
    assert_traffic_agrees(measured, predicted_matrix(parse_config(EXPERT_RUN)).by_kind[kind])


# A mixture of experts under tensor parallelism gathers every rank's routing and runs its slice of the experts on
# every token: with sequence parallelism beside a shared expert (a dense block's collectives of its own), without
# it taking its part of the sequence in and giving the whole back.
@pytest.fixture(scope="module", params=[True, False], ids=["sequence_parallel", "no_sequence_parallel"])
def tensor_parallel_experts_run(request, tmp_path_factory):
    document = {
        **HYBRID_RUN,
        "model": {**HYBRID_RUN["model"], "experts": 4, "top_k": 2, "moe": {"shared_expert": request.param}},
        "parallel": {"tp": 2, "sequence_parallel": request.param},
    }
    run = run_trainer(tmp_path_factory.mktemp("tensor-parallel-experts"), document)
    assert run.returncode == 0, run.output[-4000:]
    return document, run.traffic_per_step(("tp",), after_step=1, steps=STEPS)["tp"]


def test_a_tensor_parallel_mixture_of_experts_moves_what_the_planner_predicts(tensor_parallel_experts_run):
    document, measured = tensor_parallel_experts_run
    assert talking(measured) == {(0, 1), (1, 0)}
    assert_traffic_agrees(measured, predicted_matrix(parse_config(document)).by_kind["tp"])


def test_expert_parallelism_beside_tensor_parallelism_moves_what_the_planner_predicts(tmp_path):
    """dp_shard 2 × tp 2 with ep 2: the all-to-alls between the tp ranks' counterparts carry every gathered token,
    each expert's columns are reduced over the ranks that hold the same ones, and tp moves what a tensor-parallel
    mixture of experts moves."""
    document = {**EXPERT_RUN, "parallel": {"dp_shard": 2, "tp": 2, "ep": 2}}
    run = run_trainer(tmp_path, document)
    assert run.returncode == 0, run.output[-4000:]
    measured = run.traffic_per_step(("ep", "dp", "tp"), after_step=1, steps=STEPS)
    predicted = predicted_matrix(parse_config(document)).by_kind
    for kind, matrix in measured.items():
        assert talking(matrix) == talking(predicted[kind]), kind
        assert_traffic_agrees(matrix, predicted[kind])
