"""The detectors on series with known anomalies, and on noisy clean ones that must raise nothing."""

import math
import random

import pytest

from loom.alerts import detectors
from loom.alerts.detectors import StepRow
from trainer.config import AlertsConfig, ConfigError, ParallelConfig, parse_config

CONFIG = AlertsConfig()
TOKENS_PER_STEP = 10_000


def training_rows(steps: int, seed: int = 0, **overrides) -> list[StepRow]:
    """A clean run: loss decaying with 3 % noise, grad norm wandering around 1, steady tokens/s and memory."""
    rng = random.Random(seed)
    rows = []
    for step in range(1, steps + 1):
        loss = (2.0 + 8.0 * math.exp(-step / 30)) * (1 + rng.gauss(0, 0.03))
        values = {
            "loss": loss,
            "grad_norm": 1.0 + 0.5 * math.exp(-step / 20) + rng.gauss(0, 0.05),
            "tokens_per_s": 10_000 * (1 + rng.gauss(0, 0.02)),
            "memory_bytes": 2**30 + rng.randrange(2**20),
            "memory_rank": 0,
        }
        values.update({name: value(step, values[name]) for name, value in overrides.items()})
        # A second a step at full speed.
        rows.append(StepRow(step, **values, step_time_s=TOKENS_PER_STEP / values["tokens_per_s"]))
    return rows


def all_findings(rows, config=CONFIG):
    return (
        detectors.loss_spikes(rows, config, 0)
        + detectors.grad_norm_spikes(rows, config, 0)
        + detectors.throughput_drop(rows, config)
        + detectors.memory_creep(rows, config)
    )


@pytest.mark.parametrize("seed", range(20))
def test_clean_noisy_runs_raise_nothing(seed):
    assert all_findings(training_rows(300, seed)) == []


def test_a_loss_spike_is_found_at_its_step_and_only_there():
    rows = training_rows(120, loss=lambda step, v: v * 3 if step == 90 else v)
    findings = detectors.loss_spikes(rows, CONFIG, 0)
    assert [(f.rule, f.step, f.rank) for f in findings] == [(detectors.LOSS_SPIKE, 90, None)]
    assert findings[0].details["z"] >= CONFIG.loss_spike_z
    # Judged already: a pass after step 90 does not find it again.
    assert detectors.loss_spikes(rows, CONFIG, 90) == []


def test_ten_times_the_windows_highest_is_a_spike_even_in_a_wild_window():
    # A window so noisy that no z-score stands out: the multiple of its highest still catches the jump.
    rng = random.Random(1)
    rows = [StepRow(step, loss=rng.uniform(1, 5)) for step in range(1, 60)] + [StepRow(60, loss=80.0)]
    config = AlertsConfig(loss_spike_z=1000)
    (finding,) = detectors.loss_spikes(rows, config, 0)
    assert finding.step == 60 and "10× the window's highest" in finding.message


def test_a_spike_needs_min_history_steps_before_it():
    rows = training_rows(40, loss=lambda step, v: v * 5 if step == 8 else v)
    assert detectors.loss_spikes(rows, AlertsConfig(min_history=10), 0) == []
    assert [f.step for f in detectors.loss_spikes(rows, AlertsConfig(min_history=5, window=5), 0)] == [8]


def test_early_training_swings_are_no_spikes():
    # As the demo run's first steps: norms swinging around 3 (one step at 6.4, 6 robust deviations up) and a
    # loss that wobbles by a few per cent in a very calm window.
    rng = random.Random(3)
    rows = [
        StepRow(step, loss=5.0 + rng.gauss(0, 0.001), grad_norm=3.0 * math.exp(rng.gauss(0, 0.15)))
        for step in range(1, 40)
    ]
    rows.append(StepRow(40, loss=5.2, grad_norm=6.4))
    assert detectors.robust_z(6.4, [row.grad_norm for row in rows[-41:-1]]) > CONFIG.grad_norm_spike_z
    assert detectors.robust_z(5.2, [row.loss for row in rows[-41:-1]]) > CONFIG.loss_spike_z
    assert detectors.grad_norm_spikes(rows, CONFIG, 0) == [] and detectors.loss_spikes(rows, CONFIG, 0) == []


def test_a_grad_norm_spike():
    rows = training_rows(100, grad_norm=lambda step, v: 25.0 if step == 70 else v)
    (finding,) = detectors.grad_norm_spikes(rows, CONFIG, 0)
    assert (finding.rule, finding.step) == (detectors.GRAD_NORM_SPIKE, 70)


def test_a_throughput_drop_needs_its_steps_running_and_its_seconds():
    slow_from = 71
    rows = training_rows(100, tokens_per_s=lambda step, v: v * 0.5 if step >= slow_from else v)
    (finding,) = detectors.throughput_drop(rows, CONFIG)
    # Two seconds a slow step: the last 15 hold throughput_drop_min_s (30 s).
    assert finding.step == 100 and finding.details["steps"] == list(range(86, 101))
    assert 30 <= finding.details["seconds"] < 32 and "for 15 steps (30." in finding.message
    # Two slow steps out of three are not a drop.
    blip = training_rows(100, tokens_per_s=lambda step, v: v * 0.5 if step in (98, 100) else v)
    assert detectors.throughput_drop(blip, CONFIG) == []


def test_a_few_slow_steps_are_no_drop_until_they_last():
    """Three steps at half speed (a checkpoint save, a busy host) are six seconds, not a drop; with the time
    floor off they are."""
    brief = training_rows(100, tokens_per_s=lambda step, v: v * 0.5 if step >= 98 else v)
    assert detectors.throughput_drop(brief, CONFIG) == []
    (finding,) = detectors.throughput_drop(brief, CONFIG.model_copy(update={"throughput_drop_min_s": 0}))
    assert finding.details["steps"] == [98, 99, 100]


def test_memory_creep_names_the_rank_and_a_flat_or_one_off_rise_is_not_creep():
    creeping = training_rows(60, memory_bytes=lambda step, v: 2**30 + step * 2**24, memory_rank=lambda s, v: 5)
    (finding,) = detectors.memory_creep(creeping, CONFIG)
    assert (finding.rule, finding.rank, finding.step) == (detectors.MEMORY_CREEP, 5, 60)
    # One jump at the end (a bigger batch, a checkpoint buffer) rises in the last third only.
    jump = training_rows(60, memory_bytes=lambda step, v: 2**31 if step > 55 else 2**30)
    assert detectors.memory_creep(jump, CONFIG) == []


# The rules a straggler is judged by on a few steps of a few seconds: without the time floor, which
# test_a_rank_slow_for_a_moment_is_no_straggler_and_one_slow_for_straggler_min_s_is checks on its own.
MOMENTS = AlertsConfig(straggler_min_s=0)


def step_times(steps, ranks, slow_rank=None, factor=1.0):
    rng = random.Random(2)
    return {
        step: {rank: 0.5 * (factor if rank == slow_rank else 1.0) * (1 + rng.gauss(0, 0.03)) for rank in range(ranks)}
        for step in steps
    }


def test_a_straggler_is_named_with_its_host_after_straggler_steps_steps():
    times = step_times(range(1, 6), 8, slow_rank=3, factor=2.0)
    (finding,) = detectors.stragglers(times, MOMENTS, lambda rank: f"node-{rank // 4}")
    assert (finding.rule, finding.rank, finding.step) == (detectors.STRAGGLER, 3, 5)
    assert "node-0" in finding.message and finding.details["score"] < MOMENTS.straggler_score
    # Four slow steps are not yet five.
    assert detectors.stragglers(step_times(range(1, 5), 8, 3, 2.0), MOMENTS, str) == []


def test_a_rank_slow_in_all_but_one_step_is_no_straggler_and_a_mildly_slow_one_neither():
    times = step_times(range(1, 6), 8, slow_rank=3, factor=2.0)
    times[4][3] = 0.5
    assert detectors.stragglers(times, MOMENTS, str) == []
    # 1.3× the median scores 0.77, above 0.7.
    assert detectors.stragglers(step_times(range(1, 6), 8, 3, 1.3), MOMENTS, str) == []


def test_a_rank_slower_by_a_few_milliseconds_is_no_straggler_however_high_its_ratio():
    # Steps of ~28 ms, rank 0 at 1.6× (45 ms): the score is 0.62, but 17 ms a step is below the 50 ms floor.
    times = {step: {rank: 0.028 * (1.6 if rank == 0 else 1.0) for rank in range(4)} for step in range(1, 6)}
    assert detectors.stragglers(times, MOMENTS, str) == []
    (finding,) = detectors.stragglers(times, AlertsConfig(straggler_min_excess_s=0.01, straggler_min_s=0), str)
    assert finding.rank == 0


def starved_pair(slow_steps: range, steps: int = 200) -> dict[int, dict[int, float]]:
    """Two ranks sharing two busy cores, as the demo runs: ~0.13 s of own work a step, and rank 0 given less
    CPU in `slow_steps` (0.3-0.45 s, while rank 1, done early, waits in its collectives: 0.02 s of its own)."""
    rng = random.Random(7)
    balanced = {step: {rank: 0.13 * rng.uniform(0.95, 1.05) for rank in (0, 1)} for step in range(1, steps + 1)}
    starved = {step: {0: rng.uniform(0.3, 0.45), 1: 0.02} for step in slow_steps}
    return balanced | starved


def test_a_rank_slow_for_a_moment_is_no_straggler_and_one_slow_for_straggler_min_s_is():
    # Eight starved steps (the demo flagged rank 0 on them) hold ~3 s of rank 0's time: not ten.
    assert detectors.stragglers(starved_pair(range(193, 201)), CONFIG, str, "compute time") == []
    assert [f.rank for f in detectors.stragglers(starved_pair(range(193, 201)), MOMENTS, str)] == [0]
    # Starved for the last 60 steps (~22 s), it is a straggler, said to have been slow that long.
    (finding,) = detectors.stragglers(starved_pair(range(141, 201)), CONFIG, str, "compute time")
    assert (finding.rank, finding.step, finding.details["slow_steps"]) == (0, 200, 60)
    assert finding.details["seconds"] >= CONFIG.straggler_min_s and "for 60 steps" in finding.message
    # Slow for 40 steps, then itself again for one, then slow for 20 (~7.5 s): the time restarts.
    slow_again = [*range(140, 180), *range(181, 201)]
    assert detectors.stragglers(starved_pair(slow_again), CONFIG, str, "compute time") == []


def test_straggler_history_needed_holds_straggler_min_s_at_the_candidates_pace():
    (candidate,) = detectors.stragglers(starved_pair(range(196, 201), steps=200), MOMENTS, str)
    needed = detectors.straggler_history_needed([candidate], CONFIG)
    # At 0.3-0.45 s a step, ten seconds take at most 34 steps.
    assert 23 <= needed <= 35
    assert detectors.straggler_history_needed([], CONFIG) == 0


TP2_PP2 = ParallelConfig(tp=2, pp=2, microbatches=2)


def pipeline_step_times(steps, ranks, parallel, stage_seconds, slow_rank=None, factor=1.0):
    """Each rank's time is its pipeline rank's in stage_seconds, with 3 % noise and slow_rank `factor` times slower."""
    stage = detectors.pipeline_peers(parallel)
    rng = random.Random(4)
    return {
        step: {
            rank: stage_seconds[stage(rank)] * (factor if rank == slow_rank else 1.0) * (1 + rng.gauss(0, 0.03))
            for rank in range(ranks)
        }
        for step in steps
    }


def test_a_pipelines_last_stage_doing_more_work_is_no_straggler():
    # tp2 x pp2 as measured on two cores: the last stage (ranks 2 and 3) computes the output layer and the
    # loss, and the first stage's ranks wait for it, so their own work is a fraction of the last stage's.
    stages = {"pipeline rank 0": 0.03, "pipeline rank 1": 0.15}
    times = pipeline_step_times(range(1, 11), 4, TP2_PP2, stages)
    assert detectors.stragglers(times, MOMENTS, str, "compute time", detectors.pipeline_peers(TP2_PP2)) == []
    # Against every rank of the run the last stage stands out.
    assert [f.rank for f in detectors.stragglers(times, MOMENTS, str, "compute time")] == [2, 3]


def test_a_rank_slower_than_its_peer_in_the_same_pipeline_stage_is_a_straggler():
    stages = {"pipeline rank 0": 0.03, "pipeline rank 1": 0.15}
    times = pipeline_step_times(range(1, 11), 4, TP2_PP2, stages, slow_rank=3, factor=4.0)
    (finding,) = detectors.stragglers(times, MOMENTS, str, "compute time", detectors.pipeline_peers(TP2_PP2))
    assert (finding.rank, finding.step) == (3, 10)
    assert finding.details["peer_group"] == "pipeline rank 1"
    assert "against a median of" in finding.message and "among the ranks of pipeline rank 1" in finding.message
    # The median is its stage's (0.15 and 0.6 s: 0.375 s), not the run's (0.09 s).
    assert all(0.3 < median < 0.45 for median in finding.details["medians"])
    # A first-stage rank as slow as the last stage is slow for its own stage.
    times = pipeline_step_times(range(1, 11), 4, TP2_PP2, stages, slow_rank=0, factor=5.0)
    peers = detectors.pipeline_peers(TP2_PP2)
    assert [f.rank for f in detectors.stragglers(times, MOMENTS, str, "compute time", peers)] == [0]


def test_a_rank_alone_in_its_pipeline_stage_has_no_peer_to_straggle_behind():
    parallel = ParallelConfig(pp=2, microbatches=2)
    times = pipeline_step_times(range(1, 11), 2, parallel, {"pipeline rank 0": 0.02, "pipeline rank 1": 0.2})
    assert detectors.stragglers(times, MOMENTS, str, "compute time", detectors.pipeline_peers(parallel)) == []


def test_pipeline_peers_are_the_ranks_of_one_pipeline_rank_whatever_the_other_dims():
    parallel = ParallelConfig(pp=2, dp_shard=2, tp=2, microbatches=2)
    peers = detectors.pipeline_peers(parallel)
    assert [peers(rank) for rank in range(8)] == ["pipeline rank 0"] * 4 + ["pipeline rank 1"] * 4
    assert {detectors.pipeline_peers(ParallelConfig(dp_replicate=4))(rank) for rank in range(4)} == {""}


def test_non_finite_reports_make_one_critical_finding_at_the_first_bad_step():
    reports = [(rank, step, "loss", 2.5) for rank in range(4) for step in (10, 11)]
    reports += [(rank, 12, "loss", "NaN") for rank in (0, 2)] + [(1, 13, "grad_norm", "Infinity")]
    (finding,) = detectors.non_finite(reports)
    assert (finding.rule, finding.step, finding.severity, finding.ranks) == (
        detectors.NON_FINITE,
        12,
        detectors.CRITICAL,
        (0, 2),
    )
    assert finding.details["steps"] == [12, 13]
    assert detectors.non_finite([(0, 5, "loss", 1.0), (0, 5, "grad_norm", 3)]) == []


def test_robust_z_ignores_one_outlier_in_the_window():
    history = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 50.0]
    assert detectors.robust_z(1.2, history) < 6
    assert detectors.robust_z(3.0, history) > 6


def evaluated_rows(eval_loss, train_loss=lambda step: 3.0 - step / 1000, interval=100, steps=600) -> list[StepRow]:
    """Every step's training loss, and validation loss every `interval` steps (as eval.interval_steps gives it)."""
    return [
        StepRow(step, loss=train_loss(step), eval_loss=eval_loss(step) if step % interval == 0 else None)
        for step in range(1, steps + 1)
    ]


def test_rising_validation_loss_while_training_loss_falls_is_overfitting():
    # Validation falls until step 300, then rises at each of steps 400, 500 and 600; training keeps falling.
    rows = evaluated_rows(lambda step: 2.5 - step / 1000 if step <= 300 else 2.2 + (step - 300) / 1000)
    (finding,) = detectors.overfit(rows, CONFIG)
    assert (finding.rule, finding.step, finding.severity, finding.rank) == (detectors.OVERFIT, 600, "warning", None)
    assert finding.details["steps"] == [300, 400, 500, 600]
    assert finding.details["eval_losses"] == pytest.approx([2.2, 2.3, 2.4, 2.5])
    assert finding.details["train_loss_after"] < finding.details["train_loss_before"]
    assert "validation loss rose from 2.2 to 2.5 (+13.6%) over the evaluations at steps 300–600" in finding.message
    assert "training loss fell" in finding.message and "overfitting" in finding.message


@pytest.mark.parametrize(
    ("eval_loss", "train_loss"),
    [
        # Both falling: learning.
        (lambda step: 2.5 - step / 1000, lambda step: 3.0 - step / 1000),
        # Rising at two evaluations of the three needed.
        (lambda step: 2.5 - step / 1000 if step <= 400 else 2.1 + (step - 400) / 1000, lambda step: 3.0 - step / 1000),
        # Rising, but training loss rises too: diverging, which the spike detectors are for.
        (lambda step: 2.0 + step / 1000, lambda step: 2.0 + step / 1000),
        # Rising by a hair (0.1 % in all): no trend.
        (lambda step: 2.0 + step / 1e6, lambda step: 3.0 - step / 1000),
        # Flat.
        (lambda step: 2.0, lambda step: 3.0 - step / 1000),
    ],
    ids=["learning", "too-few-rises", "diverging", "a-hairs-rise", "flat"],
)
def test_no_overfitting_otherwise(eval_loss, train_loss):
    assert detectors.overfit(evaluated_rows(eval_loss, train_loss), CONFIG) == []


def test_a_run_without_evaluations_is_never_overfitting():
    assert detectors.overfit(training_rows(300), CONFIG) == []
    # Fewer evaluations than overfit_evaluations + 1, however they move.
    rows = evaluated_rows(lambda step: step / 100, steps=300)
    assert detectors.overfit(rows, CONFIG) == []
    assert detectors.overfit(rows, CONFIG.model_copy(update={"overfit_evaluations": 2}))


def test_overfit_settings_are_validated_by_field():
    with pytest.raises(ConfigError) as refused:
        parse_config({"alerts": {"overfit_evaluations": 0, "overfit_rise": -0.1}})
    assert set(refused.value.errors) == {"alerts.overfit_evaluations", "alerts.overfit_rise"}
    assert "greater than or equal to 1" in refused.value.errors["alerts.overfit_evaluations"]


EXPERTS = 8
# Routed token copies a layer takes a step: an even share is 512 an expert.
ROUTED = EXPERTS * 512
LAYERS = (0, 1)


def routed_rows(last_step: int, change=lambda step, layer, load: load, seed: int = 0) -> list[StepRow]:
    """Steps of a two-layer, eight-expert model, each expert's load within 10 % of an even share; `change`
    may rewrite a layer's load at a step."""
    rng = random.Random(seed)
    rows = []
    for step in range(1, last_step + 1):
        loads = {}
        for layer in LAYERS:
            weights = [1 + rng.uniform(-0.1, 0.1) for _ in range(EXPERTS)]
            load = [round(ROUTED * weight / sum(weights)) for weight in weights]
            loads[layer] = tuple(change(step, layer, load))
        rows.append(StepRow(step, expert_loads=loads))
    return rows


def starving(layer: int, expert: int, steps, tokens: int = 3):
    """`expert` of `layer` receives `tokens` in `steps` (3 of an even 512: 0.6 %)."""

    def change(step, at_layer, load):
        if at_layer == layer and step in steps:
            load[expert] = tokens
        return load

    return change


def hogging(layer: int, expert: int, ratio: float, steps):
    """`expert` of `layer` takes `ratio` × the mean load in `steps`, the other experts the rest evenly."""

    def change(step, at_layer, load):
        if at_layer != layer or step not in steps:
            return load
        busiest = round(ratio * ROUTED / EXPERTS)
        rest = round((ROUTED - busiest) / (EXPERTS - 1))
        return [busiest if index == expert else rest for index in range(EXPERTS)]

    return change


@pytest.mark.parametrize("seed", range(5))
def test_evenly_routed_experts_raise_nothing(seed):
    rows = routed_rows(100, seed=seed)
    assert detectors.expert_collapse(rows, CONFIG) == [] and detectors.expert_imbalance(rows, CONFIG) == []


def test_an_expert_collapses_after_expert_collapse_steps_starved_steps_and_not_one_sooner():
    starved_from = 31
    nineteen = routed_rows(49, starving(1, 5, range(starved_from, 1000)))
    assert detectors.expert_collapse(nineteen, CONFIG) == []
    (finding,) = detectors.expert_collapse(routed_rows(50, starving(1, 5, range(starved_from, 1000))), CONFIG)
    assert (finding.rule, finding.step, finding.severity, finding.rank) == (
        detectors.EXPERT_COLLAPSE,
        50,
        "warning",
        None,
    )
    (entry,) = finding.details["experts"]
    assert (entry["layer"], entry["expert"], entry["tokens"], entry["steps"]) == (1, 5, 3, [starved_from, 50])
    # Starved, it pulls its layer's mean below 512: 3 of ~448.
    assert entry["of_even_share"] == pytest.approx(3 / entry["even_share"], abs=1e-4) and entry["of_even_share"] < 0.01
    assert finding.message.startswith("expert 5 of layer 1 collapsed: 3 tokens at step 50")
    assert "under 1% of one in each of steps 31–50" in finding.message
    # Starved for longer, it is judged on all of it.
    (longer,) = detectors.expert_collapse(routed_rows(70, starving(1, 5, range(starved_from, 1000))), CONFIG)
    assert longer.details["experts"][0]["steps"] == [starved_from, 70]
    # Half its share (1 % of all tokens routed, far from nothing) is no collapse.
    assert detectors.expert_collapse(routed_rows(70, starving(1, 5, range(1, 1000), tokens=256)), CONFIG) == []


def test_a_collapsed_expert_that_gets_tokens_again_recovers_and_a_new_spell_counts_from_its_start():
    starved = [*range(11, 41), *range(42, 1000)]
    assert detectors.expert_collapse(routed_rows(40, starving(0, 2, starved)), CONFIG)
    # At step 41 it gets its share again: recovered, whatever came before.
    assert detectors.expert_collapse(routed_rows(41, starving(0, 2, starved)), CONFIG) == []
    # Starved again from step 42: collapsed once more only after another twenty steps.
    assert detectors.expert_collapse(routed_rows(60, starving(0, 2, starved)), CONFIG) == []
    (finding,) = detectors.expert_collapse(routed_rows(61, starving(0, 2, starved)), CONFIG)
    assert finding.details["experts"][0]["steps"] == [42, 61]


def test_a_step_a_layer_did_not_report_breaks_its_spell():
    rows = routed_rows(60, starving(1, 5, range(11, 1000)))
    # Layer 1's stage never reported step 45: steps 46-60 are fifteen steps running, not fifty.
    gap = [StepRow(row.step, expert_loads={0: row.expert_loads[0]}) if row.step == 45 else row for row in rows]
    assert detectors.expert_collapse(gap, CONFIG) == []
    (finding,) = detectors.expert_collapse(gap, CONFIG.model_copy(update={"expert_collapse_steps": 15}))
    assert finding.details["experts"][0]["steps"] == [46, 60]


def test_collapse_is_judged_against_an_even_share_not_all_tokens():
    # 256 experts: an even share is 0.39 % of the tokens. An expert at a third of it (0.13 % of all tokens) is
    # starved but not collapsed; one at 0.5 % of an even share is.
    even = 100
    load = [even] * 256
    load[7], load[200] = even // 3, 0
    rows = [StepRow(step, expert_loads={3: tuple(load)}) for step in range(1, 21)]
    (finding,) = detectors.expert_collapse(rows, CONFIG)
    assert [(entry["layer"], entry["expert"]) for entry in finding.details["experts"]] == [(3, 200)]


def test_several_collapsed_experts_make_one_finding_naming_each_with_its_layer():
    def both(step, layer, load):
        return starving(1, 6, range(1, 100))(step, layer, starving(0, 2, range(5, 100))(step, layer, load))

    (finding,) = detectors.expert_collapse(routed_rows(30, both), CONFIG)
    assert [(entry["layer"], entry["expert"], entry["steps"]) for entry in finding.details["experts"]] == [
        (0, 2, [5, 30]),
        (1, 6, [1, 30]),
    ]
    assert finding.message.startswith("2 experts collapsed, each under 1% of an even share")
    assert "expert 2 of layer 0 (0.7%), expert 6 of layer 1 (0.7%)" in finding.message


def test_a_layer_whose_busiest_expert_takes_over_the_ratio_for_its_steps_is_imbalanced():
    hogged = hogging(0, 3, 5.0, range(21, 1000))
    assert detectors.expert_imbalance(routed_rows(39, hogged), CONFIG) == []
    (finding,) = detectors.expert_imbalance(routed_rows(40, hogged), CONFIG)
    assert (finding.rule, finding.step, finding.severity, finding.rank) == (
        detectors.EXPERT_IMBALANCE,
        40,
        "warning",
        None,
    )
    (entry,) = finding.details["layers"]
    assert (entry["layer"], entry["busiest_expert"], entry["steps"]) == (0, 3, [21, 40])
    assert entry["ratio"] == pytest.approx(5.0, abs=0.01)
    assert finding.message == (
        "layer 0's expert load is imbalanced: expert 3 received 5.00× the layer's mean load at step 40, over 4× in "
        "each of steps 21–40"
    )
    # Just under the ratio is balanced enough; back to an even split, the layer has recovered.
    assert detectors.expert_imbalance(routed_rows(60, hogging(0, 3, 3.9, range(1, 1000))), CONFIG) == []
    assert detectors.expert_imbalance(routed_rows(41, hogging(0, 3, 5.0, range(21, 41))), CONFIG) == []


def test_dense_runs_and_expert_rules_set_to_zero_raise_nothing():
    assert detectors.expert_collapse(training_rows(100), CONFIG) == []
    assert detectors.expert_imbalance(training_rows(100), CONFIG) == []
    starved = routed_rows(60, starving(1, 5, range(1, 1000)))
    hogged = routed_rows(60, hogging(0, 3, 6.0, range(1, 1000)))
    assert detectors.expert_collapse(starved, CONFIG) and detectors.expert_imbalance(hogged, CONFIG)
    off = AlertsConfig(expert_collapse_share=0, expert_imbalance_ratio=0)
    assert detectors.expert_collapse(starved, off) == [] and detectors.expert_imbalance(hogged, off) == []


def test_expert_settings_are_validated_by_field():
    with pytest.raises(ConfigError) as refused:
        parse_config(
            {
                "alerts": {
                    "expert_collapse_share": 1.0,
                    "expert_collapse_steps": 0,
                    "expert_imbalance_ratio": 0.8,
                    "expert_imbalance_steps": 1001,
                }
            }
        )
    assert set(refused.value.errors) == {
        "alerts.expert_collapse_share",
        "alerts.expert_collapse_steps",
        "alerts.expert_imbalance_ratio",
        "alerts.expert_imbalance_steps",
    }
    assert "above 1" in refused.value.errors["alerts.expert_imbalance_ratio"]
    assert "or 0 to turn the rule off" in refused.value.errors["alerts.expert_imbalance_ratio"]
    assert "less than 1" in refused.value.errors["alerts.expert_collapse_share"]
    defaults = parse_config({}).alerts
    assert (defaults.expert_collapse_share, defaults.expert_collapse_steps) == (0.01, 20)
    assert (defaults.expert_imbalance_ratio, defaults.expert_imbalance_steps) == (4.0, 20)
    off = parse_config({"alerts": {"expert_collapse_share": 0, "expert_imbalance_ratio": 0}}).alerts
    assert (off.expert_collapse_share, off.expert_imbalance_ratio) == (0, 0)
