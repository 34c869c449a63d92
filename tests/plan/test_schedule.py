import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainer.config import PIPELINE_SCHEDULES, V_SCHEDULES
from trainer.plan.schedule import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    ZERO_BUBBLE_SCHEDULES,
    Action,
    check_schedule,
    closed_form_bubble,
    op_orders,
    rank_of_stage,
    simulate,
)

REPO = Path(__file__).resolve().parents[2]


def stages_per_rank(schedule: str) -> int:
    return 1 if schedule in ("GPipe", "1F1B") else 2


def layouts(schedules=PIPELINE_SCHEDULES, pps=(2, 3, 4), extra_microbatches=(0, 1, 2, 5)):
    """(schedule, p, m, v) that PyTorch can run, from m = p up."""
    for schedule in schedules:
        for p in pps:
            for m in sorted({p + extra for extra in extra_microbatches} | {2 * p, 3 * p}):
                v = stages_per_rank(schedule)
                try:
                    check_schedule(schedule, p, m, v)
                except ValueError:
                    continue
                yield schedule, p, m, v


# Closed forms


@pytest.mark.parametrize(
    ("schedule", "p", "m", "v", "bubble"),
    [
        ("GPipe", 4, 8, 1, 3 / 8),
        ("1F1B", 4, 8, 1, 3 / 8),
        ("1F1B", 8, 64, 1, 7 / 64),
        ("Interleaved1F1B", 4, 8, 2, 3 / 16),
        ("LoopedBFS", 4, 8, 4, 3 / 32),
        ("InterleavedZeroBubble", 4, 8, 2, 3 / 48),
        ("ZBVZeroBubble", 4, 8, 2, 3 / 48),
        ("ZBVZeroBubble", 4, 4, 2, (3 + 3) / 24),
        ("DualPipeV", 4, 8, 2, 3 / 48),
    ],
)
def test_closed_form_bubble_values(schedule, p, m, v, bubble):
    assert closed_form_bubble(schedule, p, m, v) == pytest.approx(bubble)


def test_a_single_pipeline_rank_has_no_bubble():
    assert closed_form_bubble("1F1B", 1, 4, 1) == 0
    assert simulate("1F1B", 1, 4, 1, 1.0, 1.0, 1.0).bubble_fraction == 0


# Validation


@pytest.mark.parametrize(
    ("schedule", "p", "m", "v", "message"),
    [
        ("PipeDream", 4, 8, 1, "unknown pipeline schedule 'PipeDream'"),
        ("1F1B", 0, 8, 1, "pp must be at least 1"),
        ("1F1B", 4, 3, 1, "microbatches must be at least pp=4"),
        ("GPipe", 4, 8, 2, "stages_per_rank must be 1 for GPipe"),
        ("Interleaved1F1B", 4, 8, 1, "stages_per_rank must be at least 2 for Interleaved1F1B"),
        ("ZBVZeroBubble", 4, 8, 3, "stages_per_rank must be 2 for ZBVZeroBubble"),
        ("Interleaved1F1B", 4, 9, 2, "microbatches=9 must be a multiple of m // pp = 2"),
        ("InterleavedZeroBubble", 4, 9, 2, "nearby valid choices: [8, 10]"),
        ("DualPipeV", 4, 7, 2, "at least 2 × pp = 8 for DualPipeV"),
    ],
)
def test_invalid_layouts_are_refused_with_what_would_be_right(schedule, p, m, v, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        closed_form_bubble(schedule, p, m, v)
    with pytest.raises(ValueError, match=re.escape(message)):
        simulate(schedule, p, m, v, 1.0, 1.0, 1.0)


@pytest.mark.parametrize(
    ("times", "p2p_s", "message"),
    [
        (([1.0, 1.0, 1.0], 1.0, 1.0), 0.0, "forward_s needs one time per stage (pp × stages_per_rank = 4), got 3"),
        ((1.0, -1.0, 1.0), 0.0, "backward_input_s must not be negative"),
        ((1.0, 1.0, 1.0), -0.1, "p2p_s must be at least 0"),
        ((0.0, 0.0, 0.0), 0.0, "all zero"),
    ],
)
def test_invalid_times_are_refused(times, p2p_s, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        simulate("1F1B", 4, 8, 1, *times, p2p_s=p2p_s)


# Simulated bubble against the closed forms


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m_over_p", [1, 2, 3, 8])
@pytest.mark.parametrize("times", [(1.0, 1.0, 1.0), (1.0, 1.7, 0.6), (0.3, 1.0, 0.0)])
def test_simulated_bubble_equals_the_closed_form_for_one_stage_schedules(schedule, p, m_over_p, times):
    m = m_over_p * p + (1 if m_over_p == 3 else 0)
    timeline = simulate(schedule, p, m, 1, *times)
    assert timeline.bubble_fraction == pytest.approx(closed_form_bubble(schedule, p, m, 1), rel=1e-9)
    assert timeline.step_s == pytest.approx((m + p - 1) * sum(times))


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "LoopedBFS"])
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("m_over_p", [1, 2, 4])
@pytest.mark.parametrize("times", [(1.0, 1.0, 1.0), (1.0, 1.7, 0.6)])
def test_simulated_bubble_matches_the_closed_form_for_looped_schedules(schedule, p, v, m_over_p, times):
    m = m_over_p * p
    timeline = simulate(schedule, p, m, v, *times)
    assert timeline.bubble_fraction == pytest.approx(closed_form_bubble(schedule, p, m, v), abs=1e-3)


@pytest.mark.parametrize(("schedule", "p", "m", "v"), list(layouts(ZERO_BUBBLE_SCHEDULES, pps=(2, 3, 4, 8))))
def test_simulated_bubble_equals_the_closed_form_for_zero_bubble_schedules_with_equal_op_times(schedule, p, m, v):
    timeline = simulate(schedule, p, m, v, 1.0, 1.0, 1.0)
    assert timeline.bubble_fraction == pytest.approx(closed_form_bubble(schedule, p, m, v), rel=1e-9)


@pytest.mark.parametrize(("schedule", "p", "m", "v"), list(layouts(ZERO_BUBBLE_SCHEDULES, pps=(2, 4, 8))))
@pytest.mark.parametrize("times", [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (1.0, 1.2, 0.9)])
def test_zero_bubble_schedules_idle_less_than_1f1b(schedule, p, m, v, times):
    # The same model cut into p·v stages: each stage carries 1/v of a 1F1B stage's work.
    chunk_times = [t / v for t in times]
    zero_bubble = simulate(schedule, p, m, v, *chunk_times)
    one_f_one_b = simulate("1F1B", p, m, 1, *times)
    assert zero_bubble.bubble_fraction < one_f_one_b.bubble_fraction
    assert zero_bubble.step_s < one_f_one_b.step_s


def test_uneven_stages_stretch_the_step_to_the_slowest_rank():
    even = simulate("1F1B", 4, 8, 1, 1.0, 1.0, 1.0)
    heavy_last = simulate("1F1B", 4, 8, 1, [1.0, 1.0, 1.0, 2.0], [1.0, 1.0, 1.0, 2.0], 1.0)
    assert heavy_last.busy_s[3] == pytest.approx(8 * 5.0)
    assert heavy_last.step_s > even.step_s
    assert heavy_last.bubble_fraction > even.bubble_fraction


def test_one_time_per_stage_equal_to_a_scalar_gives_the_same_timeline():
    scalar = simulate("Interleaved1F1B", 4, 8, 2, 1.0, 1.5, 0.5, p2p_s=0.1)
    listed = simulate("Interleaved1F1B", 4, 8, 2, [1.0] * 8, [1.5] * 8, [0.5] * 8, p2p_s=0.1)
    assert listed.to_json() == scalar.to_json()


def test_gpipe_pays_each_hop_once_forward_and_once_backward():
    p, m, p2p_s = 4, 8, 0.25
    timeline = simulate("GPipe", p, m, 1, 1.0, 1.0, 1.0, p2p_s=p2p_s)
    assert timeline.step_s == pytest.approx((m + p - 1) * 3.0 + 2 * (p - 1) * p2p_s)


def test_v_schedules_hand_over_between_their_two_middle_stages_for_free():
    p = 4
    timeline = simulate("ZBVZeroBubble", p, 8, 2, 1.0, 1.0, 1.0, p2p_s=0.5)
    first_forward = {(op.stage, op.microbatch): op for op in timeline.ops if op.kind == FORWARD}
    assert first_forward[p, 0].start_s == first_forward[p - 1, 0].end_s
    assert first_forward[p - 1, 0].start_s == first_forward[p - 2, 0].end_s + 0.5


# Timelines are consistent


def uneven_timeline(schedule, p, m, v):
    stages = p * v
    forward = [1.0 + 0.1 * (stage % 3) for stage in range(stages)]
    backward = [1.4 + 0.2 * (stage % 2) for stage in range(stages)]
    weight = [0.7 + 0.05 * stage for stage in range(stages)]
    return simulate(schedule, p, m, v, forward, backward, weight, p2p_s=0.05)


@pytest.mark.parametrize(("schedule", "p", "m", "v"), list(layouts()))
def test_every_op_waits_for_its_inputs_and_ranks_run_one_op_at_a_time(schedule, p, m, v):
    timeline = uneven_timeline(schedule, p, m, v)
    last = p * v - 1
    hop = 0.05
    done = {(op.kind, op.stage, op.microbatch): op for op in timeline.ops}

    def ready(kind, stage, microbatch, rank):
        source = done[kind, stage, microbatch]
        return source.end_s + (hop if source.rank != rank else 0.0)

    for op in timeline.ops:
        assert op.rank == rank_of_stage(schedule, p, op.stage)
        if op.kind == FORWARD and op.stage > 0:
            assert op.start_s >= ready(FORWARD, op.stage - 1, op.microbatch, op.rank) - 1e-9
        if op.kind == BACKWARD:
            assert op.start_s >= done[FORWARD, op.stage, op.microbatch].end_s - 1e-9
            if op.stage < last:
                assert op.start_s >= ready(BACKWARD, op.stage + 1, op.microbatch, op.rank) - 1e-9
        if op.kind == WEIGHT:
            assert op.start_s >= done[BACKWARD, op.stage, op.microbatch].end_s - 1e-9
    for rank in range(p):
        rank_ops = sorted((op for op in timeline.ops if op.rank == rank), key=lambda op: op.start_s)
        for before, after in zip(rank_ops, rank_ops[1:], strict=False):
            assert after.start_s >= before.end_s - 1e-9
    assert timeline.step_s == max(op.end_s for op in timeline.ops)


@pytest.mark.parametrize(("schedule", "p", "m", "v"), list(layouts()))
def test_every_stage_runs_each_microbatch_forward_backward_and_weight_once(schedule, p, m, v):
    timeline = uneven_timeline(schedule, p, m, v)
    counts = Counter((op.kind, op.stage, op.microbatch) for op in timeline.ops)
    weight_in_backward = {(op.stage, op.microbatch) for op in timeline.ops if op.includes_weight}
    for stage in range(p * v):
        for microbatch in range(m):
            assert counts[FORWARD, stage, microbatch] == 1
            assert counts[BACKWARD, stage, microbatch] == 1
            separate_weight = (stage, microbatch) not in weight_in_backward
            assert counts[WEIGHT, stage, microbatch] == (1 if separate_weight else 0)
    assert sum(counts.values()) == len(timeline.ops)
    if schedule not in ZERO_BUBBLE_SCHEDULES:
        assert len(weight_in_backward) == p * v * m
    elif schedule != "DualPipeV":
        assert not weight_in_backward


@pytest.mark.parametrize(("schedule", "p", "m", "v"), list(layouts()))
def test_busy_time_is_every_stage_of_the_rank_times_every_microbatch(schedule, p, m, v):
    times = (1.0, 1.5, 0.5)
    timeline = simulate(schedule, p, m, v, *times)
    assert timeline.busy_s == pytest.approx([v * m * sum(times)] * p)


# Peak in-flight microbatches


@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 8), (8, 13)])
def test_gpipe_holds_every_microbatch_on_every_rank(p, m):
    assert simulate("GPipe", p, m, 1, 1.0, 1.0, 1.0).peak_in_flight == [m] * p


@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 8), (8, 13)])
def test_1f1b_holds_p_minus_r_on_rank_r(p, m):
    timeline = simulate("1F1B", p, m, 1, 1.0, 1.0, 1.0)
    assert timeline.peak_in_flight == [p - rank for rank in range(p)]
    assert timeline.peak_in_flight_by_stage == timeline.peak_in_flight


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 16, 3), (8, 16, 2)])
def test_interleaved_1f1b_holds_megatrons_warm_up_plus_one(p, m, v):
    # Megatron-LM warms up (v − 1)·p + 2(p − r − 1) chunks, then runs one more forward before the
    # first backward frees one: counted in stage-microbatches, 1/v of the rank's layers each.
    timeline = simulate("Interleaved1F1B", p, m, v, 1.0, 1.0, 1.0)
    assert timeline.peak_in_flight == [(v - 1) * p + 2 * (p - rank - 1) + 1 for rank in range(p)]


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 16, 3)])
def test_interleaved_zero_bubble_warms_up_one_chunk_per_hop(p, m, v):
    timeline = simulate("InterleavedZeroBubble", p, m, v, 1.0, 1.0, 1.0)
    assert timeline.peak_in_flight == [(v - 1) * p + (p - rank - 1) + 1 for rank in range(p)]


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 8, 3)])
def test_looped_bfs_holds_every_microbatch_of_every_local_stage(p, m, v):
    assert simulate("LoopedBFS", p, m, v, 1.0, 1.0, 1.0).peak_in_flight == [v * m] * p


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (8, 32)])
def test_v_schedules_hold_the_same_on_every_rank(p, m):
    # ZB-V holds 1F1B's first-rank activations (p stages' worth = 2p half-stages) on every rank.
    assert simulate("ZBVZeroBubble", p, m, 2, 1.0, 1.0, 1.0).peak_in_flight == [2 * p] * p
    assert simulate("DualPipeV", p, m, 2, 1.0, 1.0, 1.0).peak_in_flight == [2 * p + 1] * p


# Output


def test_to_json_is_json_and_describes_every_op():
    timeline = simulate("ZBVZeroBubble", 2, 4, 2, 1.0, 1.0, 1.0, p2p_s=0.1)
    document = json.loads(json.dumps(timeline.to_json()))
    assert document["schedule"] == "ZBVZeroBubble"
    assert (document["pp"], document["microbatches"], document["stages_per_rank"]) == (2, 4, 2)
    assert document["step_s"] == timeline.step_s
    assert document["bubble_fraction"] == timeline.bubble_fraction
    assert document["peak_in_flight"] == timeline.peak_in_flight
    assert len(document["ops"]) == len(timeline.ops)
    first = document["ops"][0]
    assert set(first) == {"r", "s", "mb", "k", "w", "t0", "t1"}
    assert (first["r"], first["s"], first["mb"], first["k"], first["t0"]) == (0, 0, 0, "F", 0.0)


def test_importing_the_module_does_not_import_torch_or_numpy():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['numpy'] = None\n"
        "import trainer.plan.schedule as schedule\n"
        "print(schedule.simulate('1F1B', 2, 2, 1, 1.0, 1.0, 1.0).bubble_fraction)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout) == pytest.approx(0.5)


# Op orders against PyTorch's own


def pytorch_orders(schedule: str, p: int, m: int, v: int) -> list[list[Action]]:
    """The compute ops PyTorch's schedule class plans for every rank, as Actions.

    The classes plan every rank's order when built; stand-in stages carry what the constructors read."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    schedule_class = schedules.get_schedule_class(schedule)
    stages = p * v
    if issubclass(schedule_class, schedules.PipelineScheduleMulti):
        held = [0, stages - 1] if schedule in V_SCHEDULES else list(range(0, stages, p))
        stand_ins = [
            SimpleNamespace(num_stages=stages, group_size=p, group_rank=0, stage_index=index, submod=None)
            for index in held
        ]
        built = schedule_class(stand_ins, n_microbatches=m, loss_fn=lambda output, target: output)
    else:
        stand_in = SimpleNamespace(num_stages=p, group_size=p, group_rank=0, stage_index=0, submod=None)
        built = schedule_class(stand_in, n_microbatches=m, loss_fn=lambda output, target: output)
    kinds = {"F": (FORWARD, False), "I": (BACKWARD, False), "B": (BACKWARD, True), "W": (WEIGHT, False)}
    orders = []
    for rank in range(p):
        actions = []
        for action in built.pipeline_order[rank]:
            if action is None:
                continue
            for part in action.sub_actions or (action,):
                kind = part.computation_type.value
                if kind in kinds:
                    name, includes_weight = kinds[kind]
                    actions.append(Action(name, part.stage_index, part.microbatch_index, includes_weight))
        orders.append(actions)
    return orders


@pytest.mark.parametrize(
    ("schedule", "p", "m", "v"),
    [
        *layouts(pps=(2, 3, 4)),
        ("Interleaved1F1B", 4, 8, 3),
        ("Interleaved1F1B", 3, 5, 4),
        ("LoopedBFS", 3, 6, 3),
        ("InterleavedZeroBubble", 4, 8, 3),
        ("InterleavedZeroBubble", 4, 6, 4),
    ],
)
def test_op_orders_are_pytorchs(schedule, p, m, v):
    ours, theirs = op_orders(schedule, p, m, v), pytorch_orders(schedule, p, m, v)
    if schedule == "1F1B":
        # Schedule1F1B's planned table numbers the last rank's forwards from 1; the loop that runs
        # (Schedule1F1B._step_microbatches) starts at 0, as ours does.
        last = p - 1
        assert ours[last] == [
            action for mb in range(m) for action in (Action(FORWARD, last, mb), Action(BACKWARD, last, mb, True))
        ]
        ours, theirs = ours[:last], theirs[:last]
    assert ours == theirs
