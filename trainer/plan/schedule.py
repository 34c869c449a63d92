"""Pipeline schedules drawn as a timeline, and the pipeline bubble read from it.

Two views of the same question, "how much of a training step do pipeline ranks sit idle":

- `closed_form_bubble` — the textbook bubble rate of a named schedule, cheap enough for the
  layout search to call thousands of times;
- `simulate` — every rank runs the compute ops of PyTorch's schedule (`torch.distributed.pipelining`,
  by the same name) in PyTorch's order, each op starting once its rank is free and its inputs have
  arrived. The result is a `Timeline` the designer page draws, with the bubble and the peak number of
  microbatch activations each rank holds.

Vocabulary: p pipeline ranks, m microbatches, v stages per rank (virtual stages, "chunks"), p·v
stages in all. F is a stage's forward for one microbatch, B its backward for the input gradient
and W its backward for the weight gradient. Schedules without zero-bubble splitting run B and W as
one op, recorded as B (with `includes_weight`). Stage placement follows the trainer
(`trainer.parallel.pipeline.stage_indices`): looping placement puts stage r + k·p on rank r; the V
schedules put stages r and 2p−1−r on rank r, so the first and the last stage share rank 0.

Pure Python: the planner imports this without torch.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from trainer.config import (
    LOOPED_SCHEDULES,
    ONE_STAGE_SCHEDULES,
    PIPELINE_SCHEDULES,
    ROUND_SCHEDULES,
    V_SCHEDULES,
)

FORWARD = "F"
BACKWARD = "B"
WEIGHT = "W"

ZERO_BUBBLE_SCHEDULES = frozenset({"InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"})
"""Schedules that run the weight gradient (W) as an op of its own, to fill idle time with it."""


class Action(NamedTuple):
    """One compute op in a rank's order: what the schedule runs, before any timing."""

    kind: str
    stage: int
    microbatch: int
    includes_weight: bool = False
    """For a B: the weight gradient runs inside this op (no separate W for this stage and microbatch)."""


@dataclass(slots=True)
class Op:
    """One compute op as it ran in the simulation.

    Not frozen: a timeline holds thousands, and frozen dataclasses are several times slower to build."""

    rank: int
    stage: int
    microbatch: int
    kind: str
    """"F" forward, "B" input-gradient backward, "W" weight-gradient backward."""
    start_s: float
    end_s: float
    includes_weight: bool = False
    """A B that also computes the weight gradient (every B of a schedule without zero-bubble splitting)."""


@dataclass(frozen=True)
class Timeline:
    """One training step's pipeline compute, op by op, as `simulate` drew it."""

    schedule: str
    pp: int
    microbatches: int
    stages_per_rank: int
    ops: list[Op]
    """Ordered by rank, then start time."""
    step_s: float
    """Makespan: from the first op's start to the last op's end."""
    busy_s: list[float]
    """Compute seconds per rank."""
    peak_in_flight: list[int]
    """Per rank, the most (stage, microbatch) pairs held at once: forward run on that rank, its B not
    yet done. Units are stage-microbatches: multiply by one stage's activations for one microbatch."""
    peak_in_flight_by_stage: list[int]
    """The same count per global stage."""

    @property
    def bubble_fraction(self) -> float:
        """Idle rank-time over compute rank-time: (step_s · p − Σ busy) / Σ busy.

        Measured against the ideal (busy) time rather than the step, as the textbook formulas are:
        (p−1)/m for GPipe and 1F1B, whatever F, B and W cost, when every stage costs the same."""
        busy = sum(self.busy_s)
        return (self.step_s * self.pp - busy) / busy

    def to_json(self) -> dict:
        """A JSON-able dict for the designer page's timeline.

        Keys: schedule, pp, microbatches, stages_per_rank, step_s, bubble_fraction, busy_s (per rank),
        peak_in_flight (per rank), peak_in_flight_by_stage (per stage), and ops: one dict per op with
        r (rank), s (global stage), mb (microbatch), k ("F", "B" or "W"), w (true when a B includes
        the weight gradient), t0 and t1 (start and end, seconds from the step's start)."""
        return {
            "schedule": self.schedule,
            "pp": self.pp,
            "microbatches": self.microbatches,
            "stages_per_rank": self.stages_per_rank,
            "step_s": self.step_s,
            "bubble_fraction": self.bubble_fraction,
            "busy_s": list(self.busy_s),
            "peak_in_flight": list(self.peak_in_flight),
            "peak_in_flight_by_stage": list(self.peak_in_flight_by_stage),
            "ops": [
                {
                    "r": op.rank,
                    "s": op.stage,
                    "mb": op.microbatch,
                    "k": op.kind,
                    "w": op.includes_weight,
                    "t0": op.start_s,
                    "t1": op.end_s,
                }
                for op in self.ops
            ],
        }


def check_schedule(schedule: str, p: int, m: int, v: int) -> None:
    """Raise ValueError unless PyTorch can run `schedule` with p ranks, m microbatches, v stages per rank."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(PIPELINE_SCHEDULES)}")
    if p < 1:
        raise ValueError(f"pp must be at least 1, got {p}")
    if m < p:
        raise ValueError(f"microbatches must be at least pp={p} to keep every stage busy, got {m}")
    if schedule in ONE_STAGE_SCHEDULES and v != 1:
        raise ValueError(f"stages_per_rank must be 1 for {schedule}, got {v}; use Interleaved1F1B or LoopedBFS")
    if schedule in LOOPED_SCHEDULES and v < 2:
        raise ValueError(f"stages_per_rank must be at least 2 for {schedule}, got {v}; with 1 use 1F1B")
    if schedule in V_SCHEDULES and v != 2:
        raise ValueError(f"stages_per_rank must be 2 for {schedule} (two stages per rank, placed as a V), got {v}")
    if schedule in ROUND_SCHEDULES and not _splits_into_rounds(m, p):
        nearby = [n for n in (_rounds_neighbour(m, p, -1), _rounds_neighbour(m, p, +1)) if n is not None]
        raise ValueError(
            f"microbatches={m} must be a multiple of m // pp = {m // p} for {schedule} (PyTorch runs it in "
            f"rounds of about pp microbatches); nearby valid choices: {nearby}"
        )
    if schedule == "DualPipeV" and m < 2 * p:
        raise ValueError(f"microbatches must be at least 2 × pp = {2 * p} for DualPipeV (one per stage), got {m}")


def _splits_into_rounds(m: int, p: int) -> bool:
    return m % max(1, m // p) == 0


def _rounds_neighbour(m: int, p: int, direction: int) -> int | None:
    candidate = m + direction
    while candidate >= p:
        if _splits_into_rounds(candidate, p):
            return candidate
        candidate += direction
    return None


def closed_form_bubble(schedule: str, p: int, m: int, v: int) -> float:
    """The bubble rate of a schedule: idle rank-time over compute rank-time, every stage the same.

    - GPipe, 1F1B: (p−1)/m, whatever F, B and W cost (Huang et al. 2019 "GPipe"; Narayanan et al.
      2019 "PipeDream"): the fill-drain warm-up and cool-down.
    - Interleaved1F1B, LoopedBFS: (p−1)/(v·m) (Narayanan et al. 2021, Megatron-LM interleaved 1F1B;
      Lamy-Poirier 2023 "Breadth-First Pipeline Parallelism"): looping placement makes each
      warm-up step a chunk of 1/v of a stage.
    - InterleavedZeroBubble, ZBVZeroBubble, DualPipeV: (p−1)/(3·v·m) with F = B = W, v = 2 for the
      V schedules: a third of the looped 1F1B figure, as for ZB-H1 (Qi et al. 2023 "Zero Bubble
      Pipeline Parallelism", ICLR 2024, whose ZB-H1 leaves (p−1)/(3m)). The paper's ZB-V and ZB-H2,
      and DeepSeek-V3's DualPipe, reach (nearly) zero only with its optimizer post-validation,
      which lets the next step start while this one drains; PyTorch's runtime, like loom's
      trainer, ends the step with a synchronous optimizer step, so the warm-up skew of (p−1)
      chunk-ops per rank stays. ZB-V with fewer than (3p−1)/2 microbatches cannot fill its V: each
      microbatch short of it adds two chunk-ops of idle time per rank. These figures are what
      `simulate` measures for PyTorch's orders with F = B = W (DualPipeV's forward/backward
      overlap not counted, as PyTorch runs the pair one after the other by default).

    Cheap and torch-free: the layout search calls it for every candidate."""
    check_schedule(schedule, p, m, v)
    if schedule in ONE_STAGE_SCHEDULES:
        return (p - 1) / m
    if schedule in ZERO_BUBBLE_SCHEDULES:
        unfilled_v = max(0, 3 * p - 1 - 2 * m) if schedule == "ZBVZeroBubble" else 0
        return (p - 1 + unfilled_v) / (3 * v * m)
    return (p - 1) / (v * m)


def rank_of_stage(schedule: str, p: int, stage: int) -> int:
    """The pipeline rank that holds a global stage: looping placement, or the V for V schedules."""
    if schedule in V_SCHEDULES:
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


def op_orders(schedule: str, p: int, m: int, v: int) -> list[list[Action]]:
    """The compute ops each rank runs, in PyTorch's order for the named schedule, indexed by rank."""
    check_schedule(schedule, p, m, v)
    order_of_rank = _ORDERS[schedule]
    return [order_of_rank(rank, p, m, v) for rank in range(p)]


def _gpipe_order(rank: int, p: int, m: int, v: int) -> list[Action]:
    return [Action(FORWARD, rank, mb) for mb in range(m)] + [Action(BACKWARD, rank, mb, True) for mb in range(m)]


def _one_f_one_b_order(rank: int, p: int, m: int, v: int) -> list[Action]:
    # Rank r starts p−r forwards before its first backward can arrive: the first rank holds p.
    warmup = min(m, p - rank)
    order = [Action(FORWARD, rank, mb) for mb in range(warmup)]
    for mb in range(m):
        order.append(Action(BACKWARD, rank, mb, True))
        if warmup + mb < m:
            order.append(Action(FORWARD, rank, warmup + mb))
    return order


def _looped_bfs_order(rank: int, p: int, m: int, v: int) -> list[Action]:
    stages = [rank + k * p for k in range(v)]
    forwards = [Action(FORWARD, stage, mb) for stage in stages for mb in range(m)]
    backwards = [Action(BACKWARD, stage, mb, True) for stage in reversed(stages) for mb in reversed(range(m))]
    return forwards + backwards


def _interleaved_order(rank: int, p: int, m: int, v: int, zero_bubble: bool) -> list[Action]:
    """Megatron-LM's depth-first order, as PyTorch builds it for Interleaved1F1B and InterleavedZeroBubble.

    Microbatches go through each local stage in groups of about p (one round) before the next local
    stage takes them; backwards visit the local stages in reverse."""
    group = m // max(1, m // p)
    ops_per_kind = v * m

    def op(kind: str, index: int, local_stage: int) -> Action:
        microbatch = index // (group * v) * group + index % group
        return Action(kind, local_stage * p + rank, microbatch, kind == BACKWARD and not zero_bubble)

    def forward(index: int) -> Action:
        return op(FORWARD, index, index // group % v)

    def backward(kind: str, index: int) -> Action:
        return op(kind, index, v - 1 - index // group % v)

    # Warm-up as Megatron-LM sizes it: the rounds that fill this rank's earlier local stages, plus two
    # forwards per later rank; zero bubble takes one per later rank, which keeps the first rank at
    # 1F1B's peak of p stages' activations (ZB-H1's memory bound).
    hops = (1 if zero_bubble else 2) * (p - 1 - rank)
    warmup = min((v - 1) * group + hops, ops_per_kind)
    order = [forward(index) for index in range(warmup)]
    for index in range(ops_per_kind):
        if warmup + index < ops_per_kind:
            order.append(forward(warmup + index))
        order.append(backward(BACKWARD, index))
        # ZB-H1: rank r runs each W r backwards late and its last r at the very end, where it would
        # otherwise sit idle while the ranks before it drain.
        if zero_bubble and index >= rank:
            order.append(backward(WEIGHT, index - rank))
    if zero_bubble:
        order.extend(backward(WEIGHT, index) for index in range(ops_per_kind - rank, ops_per_kind))
    return order


def _interleaved_1f1b_order(rank: int, p: int, m: int, v: int) -> list[Action]:
    return _interleaved_order(rank, p, m, v, zero_bubble=False)


def _interleaved_zero_bubble_order(rank: int, p: int, m: int, v: int) -> list[Action]:
    return _interleaved_order(rank, p, m, v, zero_bubble=True)


class _VOrder:
    """A rank's order for a V schedule, built op by op: microbatches are numbered per stage and kind."""

    def __init__(self, rank: int, p: int, m: int):
        self.first, self.second = rank, 2 * p - 1 - rank
        self.microbatches = m
        self.count: Counter[tuple[str, int]] = Counter()
        self.actions: list[Action] = []
        self.weights_due: deque[tuple[int, int]] = deque()

    def add(self, kind: str, stage: int, includes_weight: bool = False) -> None:
        microbatch = self.count[kind, stage]
        self.count[kind, stage] += 1
        if microbatch < self.microbatches:
            self.actions.append(Action(kind, stage, microbatch, includes_weight))

    def backward(self, stage: int, split: bool) -> None:
        """A B, either leaving its W for later (`weight_due`) or computing it in the same op."""
        if split:
            self.weights_due.append((stage, self.count[BACKWARD, stage]))
        self.add(BACKWARD, stage, includes_weight=not split)

    def weight_due(self) -> None:
        if self.weights_due:
            stage, microbatch = self.weights_due.popleft()
            self.actions.append(Action(WEIGHT, stage, microbatch))


def _zbv_order(rank: int, p: int, m: int, v: int) -> list[Action]:
    """ZB-V (Qi et al. 2023, section 6) as PyTorch orders it.

    PyTorch plans at least 2p−1 microbatches, enough to fill the V, and drops the ops of those past m."""
    order = _VOrder(rank, p, m)
    first, second = order.first, order.second
    planned = max(2 * p - 1, m)
    for _ in range(2 * (p - rank) - 1):
        order.add(FORWARD, first)
    for _ in range(rank):
        order.add(FORWARD, second)
        order.add(FORWARD, first)
    for _ in range(p - rank):
        order.add(FORWARD, second)
        order.add(BACKWARD, second)
        order.add(WEIGHT, second)
    while order.count[FORWARD, second] < order.count[FORWARD, first] or order.count[FORWARD, first] < planned:
        if order.count[FORWARD, first] < planned:
            order.add(FORWARD, first)
        order.add(BACKWARD, first)
        order.add(WEIGHT, first)
        order.add(FORWARD, second)
        order.add(BACKWARD, second)
        order.add(WEIGHT, second)
    for _ in range(rank):
        order.add(BACKWARD, first)
        order.add(BACKWARD, second)
    for _ in range(p - rank):
        order.add(BACKWARD, first)
        order.add(WEIGHT, first)
    for stage in (second, first):
        while order.count[WEIGHT, stage] < order.count[BACKWARD, stage]:
            order.add(WEIGHT, stage)
    return order.actions


def _dualpipev_order(rank: int, p: int, m: int, v: int) -> list[Action]:
    """DualPipeV (DeepSeek-AI's V-shaped DualPipe) as PyTorch orders it.

    DualPipeV overlaps one microbatch's forward with another's backward on the same rank; PyTorch runs
    such a pair one after the other unless the model registers an overlapped implementation, and so
    does this order (forward first). Backwards in the steady state compute the weight gradient in the
    same op; the cool-down splits it off to fill the drain."""
    order = _VOrder(rank, p, m)
    first, second = order.first, order.second
    for _ in range(2 * (p - rank - 1)):
        order.add(FORWARD, first)
    for _ in range(rank + 1):
        order.add(FORWARD, first)
        order.add(FORWARD, second)
    for _ in range(p - rank - 1):
        order.backward(second, split=True)
        order.weight_due()
        order.add(FORWARD, second)
    for _ in range(m - 2 * p + rank + 1):
        order.add(FORWARD, first)
        order.backward(second, split=False)
        order.add(FORWARD, second)
        order.backward(first, split=False)
    for _ in range(p - rank - 1):
        order.backward(second, split=False)
        order.add(FORWARD, second)
        order.backward(first, split=False)
    split, middle = False, (rank + 1) // 2
    for index in range(rank + 1):
        # From the middle of the cool-down on, backwards leave their W to fill the drain (DualPipe's
        # rule: odd ranks switch one backward sooner than even ones).
        split = split or (index == middle and rank % 2 == 1)
        order.backward(second, split)
        split = split or (index == middle and rank % 2 == 0)
        order.backward(first, split)
    for _ in range(p - rank - 1):
        order.weight_due()
        order.backward(first, split)
    for _ in range(rank + 1):
        order.weight_due()
    return order.actions


_ORDERS: dict[str, Callable[[int, int, int, int], list[Action]]] = {
    "GPipe": _gpipe_order,
    "1F1B": _one_f_one_b_order,
    "Interleaved1F1B": _interleaved_1f1b_order,
    "LoopedBFS": _looped_bfs_order,
    "InterleavedZeroBubble": _interleaved_zero_bubble_order,
    "ZBVZeroBubble": _zbv_order,
    "DualPipeV": _dualpipev_order,
}


def simulate(
    schedule: str,
    p: int,
    m: int,
    v: int,
    forward_s: float | Sequence[float],
    backward_input_s: float | Sequence[float],
    backward_weight_s: float | Sequence[float],
    p2p_s: float = 0.0,
) -> Timeline:
    """Run one step of the named schedule on paper and return its timeline.

    Times are seconds per microbatch per stage: a number (every stage the same) or a sequence of p·v
    numbers indexed by global stage (first stage with the embedding, last with the output and loss).
    backward_input_s is B, the input gradient; backward_weight_s is W, the weight gradient. p2p_s is
    the time to hand an activation or a gradient to the next rank; stages on the same rank hand over
    for free.

    Each rank runs the ops of `op_orders` in order, one at a time. An op starts when its rank is free
    and its inputs are there: F(s, mb) after F(s−1, mb), B(s, mb) after F(s, mb) and B(s+1, mb),
    W(s, mb) after B(s, mb), each plus p2p_s when the other op ran on another rank. A B that includes
    W sends its gradient when both are done, as PyTorch does. Nothing else is modelled: compute and
    communication never contend, and the optimizer step is not part of the timeline."""
    check_schedule(schedule, p, m, v)
    stages = p * v
    durations = {
        FORWARD: _per_stage("forward_s", forward_s, stages),
        BACKWARD: _per_stage("backward_input_s", backward_input_s, stages),
        WEIGHT: _per_stage("backward_weight_s", backward_weight_s, stages),
    }
    if p2p_s < 0:
        raise ValueError(f"p2p_s must be at least 0, got {p2p_s}")
    if sum(durations[FORWARD]) + sum(durations[BACKWARD]) + sum(durations[WEIGHT]) <= 0:
        raise ValueError("forward_s, backward_input_s and backward_weight_s are all zero; give the stages a cost")
    placement = [rank_of_stage(schedule, p, stage) for stage in range(stages)]
    ops_of_rank = _run(op_orders(schedule, p, m, v), placement, durations, p2p_s, m)
    ops = [op for rank_ops in ops_of_rank for op in rank_ops]
    peak_by_rank, peak_by_stage = _peak_in_flight(ops_of_rank, stages)
    return Timeline(
        schedule=schedule,
        pp=p,
        microbatches=m,
        stages_per_rank=v,
        ops=ops,
        step_s=max(op.end_s for op in ops),
        busy_s=[sum(op.end_s - op.start_s for op in rank_ops) for rank_ops in ops_of_rank],
        peak_in_flight=peak_by_rank,
        peak_in_flight_by_stage=peak_by_stage,
    )


def _per_stage(name: str, seconds: float | Sequence[float], stages: int) -> list[float]:
    values = [float(seconds)] * stages if isinstance(seconds, int | float) else [float(s) for s in seconds]
    if len(values) != stages:
        raise ValueError(f"{name} needs one time per stage (pp × stages_per_rank = {stages}), got {len(values)}")
    if any(value < 0 for value in values):
        raise ValueError(f"{name} must not be negative, got {values}")
    return values


def _run(
    orders: list[list[Action]],
    placement: list[int],
    durations: dict[str, list[float]],
    p2p_s: float,
    m: int,
) -> list[list[Op]]:
    """Time every rank's ops: run a rank until its next op waits on another rank, then switch.

    An op's start depends only on its rank's previous op and its input, so the order ranks are
    visited in changes nothing but speed. Done times sit in one flat list: the forward of (stage,
    microbatch) at stage·m + microbatch, its backward (B) p·v·m further on."""
    last_stage = len(placement) - 1
    backward_offset = len(placement) * m
    done_at = [-1.0] * (2 * backward_offset)
    waiting: dict[int, int] = {}
    free_at = [0.0] * len(orders)
    position = [0] * len(orders)
    timed: list[list[Op]] = [[] for _ in orders]
    runnable = list(range(len(orders)))
    forward_s, backward_s, weight_s = durations[FORWARD], durations[BACKWARD], durations[WEIGHT]

    while runnable:
        rank = runnable.pop()
        order, rank_ops = orders[rank], timed[rank]
        while position[rank] < len(order):
            kind, stage, microbatch, includes_weight = order[position[rank]]
            slot = stage * m + microbatch
            # The input this op waits for; an op of the same rank that must come first (a B's own
            # forward, a W's B) is waited for too, so an inconsistent order shows up as a deadlock.
            if kind == FORWARD:
                source, source_stage, duration = slot - m, stage - 1, forward_s[stage]
            elif kind == BACKWARD:
                if done_at[slot] < 0:
                    waiting[slot] = rank
                    break
                source, source_stage = backward_offset + slot + m, stage + 1
                duration = backward_s[stage] + (weight_s[stage] if includes_weight else 0.0)
            else:
                source, source_stage, duration = backward_offset + slot, stage, weight_s[stage]
            start = free_at[rank]
            if 0 <= source_stage <= last_stage:
                arrived = done_at[source]
                if arrived < 0:
                    waiting[source] = rank
                    break
                if placement[source_stage] != rank:
                    arrived += p2p_s
                start = max(start, arrived)
            end = start + duration
            rank_ops.append(Op(rank, stage, microbatch, kind, start, end, includes_weight))
            free_at[rank] = end
            position[rank] += 1
            if kind != WEIGHT:
                done = slot if kind == FORWARD else backward_offset + slot
                done_at[done] = end
                if done in waiting:
                    runnable.append(waiting.pop(done))
    stuck = [rank for rank, order in enumerate(orders) if position[rank] < len(order)]
    if stuck:
        raise RuntimeError(f"schedule deadlocks: ranks {stuck} wait forever (an op order is inconsistent)")
    return timed


def _peak_in_flight(ops_of_rank: list[list[Op]], stages: int) -> tuple[list[int], list[int]]:
    """The most microbatch activations held at once, per rank and per stage: taken by an F, freed by
    its stage's B. A rank runs one op at a time, so its ops in order are its history."""
    by_rank = []
    by_stage = [0] * stages
    held_by_stage = [0] * stages
    for rank_ops in ops_of_rank:
        held = peak = 0
        for op in rank_ops:
            if op.kind == FORWARD:
                held += 1
                held_by_stage[op.stage] += 1
                peak = max(peak, held)
                by_stage[op.stage] = max(by_stage[op.stage], held_by_stage[op.stage])
            elif op.kind == BACKWARD:
                held -= 1
                held_by_stage[op.stage] -= 1
        by_rank.append(peak)
    return by_rank, by_stage
