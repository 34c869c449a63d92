"""Layout search: every layout of a model on a cluster that the run-config rules accept, the
fastest of those that fit in memory, and the Pareto frontier of peak memory against tokens/s.

    search({"preset": "llama3-70b"}, {"gpu": "H100-SXM", "nodes": 8}, global_batch=512)

What is searched. Every layout that uses all the cluster's GPUs (or `gpus` of them) and splits the
global batch evenly over its data-parallel ranks (data.micro_batch = global_batch / (dp_replicate ×
dp_shard)): tp from the divisors of the GPU count up to a node's GPUs (tensor parallelism across
nodes is legal but never the fast choice), sequence parallel on whenever tp > 1, cp, pp with every
schedule and stages_per_rank, microbatches (and so the micro-batch size) when pp > 1, every
dp_replicate × dp_shard split (DDP, FSDP, HSDP), ZeRO stage 0–3, reshard_after_forward on and off
under ZeRO-3, ep for mixture-of-experts models, and recompute none / selective / full. Validity is
trainer/config.py's: each section's field rules and `cross_section_errors`; every layout returned
is validated whole by `parse_config(runnable=False)` once more.

With runnable_only, only the layouts loom's trainer runs today: the rules add `unrunnable_errors`
(and every layout returned is validated with `parse_config(runnable=True)`). They are applied where
the other rules are, so an unrunnable choice (expert parallelism across replicas, say) is dropped before
anything is priced.

Every figure returned is the one `estimate()` gives the returned config (timeline=False, the
closed-form bubble). The estimate takes about half a millisecond a layout, and Llama-3 405B on 16,384
GPUs has about 720,000 valid layouts; the search prices them from parts computed with the estimate's
own functions once and shared by every layout that agrees on what the part reads:

- model states per rank signature (`state_elements`, `model_state_terms`, `buffer_terms`): per what
  each rank holds, tp, ep, ZeRO stage, sharding ranks and resharding;
- activations per pipeline rank (`layer_activation_bytes` × layers × microbatches in flight, `logits_term`,
  `pipeline_buffer_term`) for one sequence, times
  the micro-batch size: per tp, cp, recompute mode, layers held, loss or not, microbatches in flight;
- the peak memory of every pipeline choice (schedule, microbatch count) and data choice of one stage placement
  at once, as arrays (numpy): the fullest rank of a signature is the one that keeps most activations;
- FLOPs per pipeline rank (`stages_compute`): a block's kernels (`block_compute`) per tp, cp, ep and sequences in
  a microbatch, times what the rank holds and its recompute mode;
- communication (`rank_time_from`, `data_parallel_traffic`, `time_traffic`, `expose`): the pipeline's
  part per layout without its data-parallel split, the data-parallel part per split without the schedule;
- the step time (`pipeline_seconds`, `step_seconds`, `optimizer_seconds`) and the peak memory
  (`reserved_bytes`, against the GPU less `outside_allocator_terms`) are added up as the estimate
  adds them.

And it prunes with properties of the cost model, each checked against the estimate in
tests/plan/test_search.py. Memory never grows with more recompute, so where no layout of a stage placement
fits under one recompute mode, none fits under the modes that keep more. The step time is bounded from below
before it is computed: by the
busiest rank's compute and in-layer communication at the placement's fewest microbatches (more
microbatches never make tensor-, context- or expert-parallel communication shrink), then with the
exposed data-parallel communication, then exactly. Layouts are taken best bound first and a bound
is tightened only while its layout could still matter: exact times come out fastest first, so the
first `limit` are the results, and after them a layout with no less memory than one already out
can be neither in the results nor on the frontier, and is dropped at its current bound.

JSON (`SearchResult.to_json()`):

    {"evaluated": layouts checked against the rules,
     "valid": those the rules accept,
     "fitting": those that also fit in GPU memory,
     "timed": fitting layouts whose step time was computed (the others provably do not matter),
     "seconds": wall-clock time of the search,
     "message": null, or why nothing was found,
     "results": [entry, ...]   the `limit` fastest by tokens/s, fastest first,
     "pareto": [entry, ...]    no other fitting layout has less memory and more tokens/s; by memory}

    entry = {"rank": place in "results" (1 = fastest), or null for a frontier point outside them,
             "config": the full run-config document, defaults filled in (what "Launch" sends),
             "summary": "tp8 pp4 Interleaved1F1B×2 m8 dp_shard2 selective",
             "runnable": whether loom's trainer runs it today (some of fp8 and MoE it only plans),
             "tokens_per_s", "mfu", "step_s", "peak_bytes" (what the allocator holds on the fullest GPU),
             "bubble_fraction"}
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np
from pydantic import ValidationError

from trainer.config import (
    ONE_STAGE_SCHEDULES,
    PIPELINE_SCHEDULES,
    V_SCHEDULES,
    ConfigError,
    DataConfig,
    ParallelConfig,
    RunConfig,
    cross_section_errors,
    divisors,
    parse_config,
    unrunnable_errors,
)
from trainer.pipeline_split import splits
from trainer.plan.communication import data_parallel_traffic, expose, groups, time_traffic
from trainer.plan.compute import BlockCompute, RankCompute, block_compute, model_flops_per_token, stages_compute
from trainer.plan.estimate import (
    RankTime,
    most_exposed_s,
    optimizer_seconds,
    parse_plan,
    pipeline_seconds,
    rank_time_from,
    step_seconds,
)
from trainer.plan.hardware import GIB, ClusterSpec
from trainer.plan.layout import Layout
from trainer.plan.memory import (
    FREED_IN_BACKWARD,
    StateElements,
    buffer_terms,
    expert_elements,
    gradients_held_at_the_peak,
    in_flight_microbatches,
    layer_activation_bytes,
    logits_term,
    model_state_terms,
    one_replica_one_stage,
    output_layer_gradient_bytes,
    outside_allocator_terms,
    pipeline_buffer_term,
    reserved_bytes,
    state_elements,
)
from trainer.plan.parameters import RankHolding, block_kinds, rank_holding
from trainer.plan.schedule import closed_form_bubble
from trainer.plan.terms import total

# Leanest first: memory only grows along this order, so the first mode that fits nowhere ends it.
RECOMPUTE_LEANEST_FIRST = ("full", "selective", "none")
ZERO_STAGES = (0, 1, 2, 3)
# How exact a bound on a layout's step time is, loosest first (Pricer.time_what_matters).
FEWEST_MICROBATCHES_BOUND, DATA_PARALLEL_BOUND, EXACT = range(3)


class PipelineChoice(NamedTuple):
    schedule: str
    stages_per_rank: int
    microbatches: int


class DataChoice(NamedTuple):
    dp_replicate: int
    dp_shard: int
    zero_stage: int
    ep: int
    reshard_after_forward: bool


class Candidate(NamedTuple):
    """One layout: the choice made along each axis."""

    tp: int
    cp: int
    pp: int
    pipeline: PipelineChoice
    data: DataChoice
    recompute: str
    micro_batch: int
    """Sequences per data-parallel rank per step (data.micro_batch)."""


@dataclass(frozen=True)
class Found:
    """A layout the search returns, priced as `estimate()` prices its config."""

    candidate: Candidate
    config: RunConfig
    tokens_per_s: float
    mfu: float
    step_s: float
    peak_bytes: float
    bubble_fraction: float

    @property
    def summary(self) -> str:
        return summarize(self.candidate)

    @property
    def runnable(self) -> bool:
        """Whether loom's trainer runs the layout today (it only plans ZeRO-1/2, fp8, MoE, …)."""
        return not unrunnable_errors(self.config)

    def to_json(self, rank: int | None) -> dict:
        return {
            "rank": rank,
            "config": self.config.model_dump(mode="json"),
            "summary": self.summary,
            "runnable": self.runnable,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "step_s": self.step_s,
            "peak_bytes": self.peak_bytes,
            "bubble_fraction": self.bubble_fraction,
        }


@dataclass
class SearchResult:
    evaluated: int
    valid: int
    fitting: int
    timed: int
    seconds: float
    results: list[Found]
    pareto: list[Found]
    message: str | None = None

    def to_json(self) -> dict:
        places = {id(found): place for place, found in enumerate(self.results, start=1)}
        return {
            "evaluated": self.evaluated,
            "valid": self.valid,
            "fitting": self.fitting,
            "timed": self.timed,
            "seconds": self.seconds,
            "message": self.message,
            "results": [found.to_json(places[id(found)]) for found in self.results],
            "pareto": [found.to_json(places.get(id(found))) for found in self.pareto],
        }


def summarize(candidate: Candidate) -> str:
    """ "tp8 pp4 Interleaved1F1B×2 m8 dp_shard2 selective": tp, then every choice that is not the default."""
    parts = [f"tp{candidate.tp}"]
    if candidate.cp > 1:
        parts.append(f"cp{candidate.cp}")
    if candidate.pp > 1:
        pipeline = candidate.pipeline
        looped = f"×{pipeline.stages_per_rank}" if pipeline.stages_per_rank > 1 else ""
        parts += [f"pp{candidate.pp}", f"{pipeline.schedule}{looped}", f"m{pipeline.microbatches}"]
    data = candidate.data
    for name, size in (("dp_replicate", data.dp_replicate), ("dp_shard", data.dp_shard), ("ep", data.ep)):
        if size > 1:
            parts.append(f"{name}{size}")
    if data.zero_stage in (1, 2):
        parts.append(f"zero{data.zero_stage}")
    if data.zero_stage == 3 and not data.reshard_after_forward:
        parts.append("no-reshard")
    if candidate.recompute != "none":
        parts.append(candidate.recompute)
    return " ".join(parts)


def search(
    model: dict,
    cluster: dict | None,
    global_batch: int,
    *,
    seq_len: int | None = None,
    precision: str = "bf16",
    limit: int = 20,
    gpus: int | None = None,
    runnable_only: bool = False,
) -> SearchResult:
    """The `limit` fastest layouts of `model` (a run config's model section, a preset allowed) that
    fit on `cluster` at `global_batch` sequences a step, and the memory/throughput Pareto frontier;
    with `runnable_only`, of the layouts loom's trainer runs today.

    Raises ConfigError keyed by field ("global_batch", "model.layers", "cluster.nodes", …)."""
    started = time.perf_counter()
    space = SearchSpace.parse(model, cluster, global_batch, seq_len, precision, limit, gpus, runnable_only)
    pricer = Pricer(space)
    timed = pricer.time_what_matters(pricer.price_memory())
    front = frontier(timed)
    found = {candidate: pricer.found(peak, candidate) for peak, _, candidate in timed[: space.limit] + front}
    return SearchResult(
        evaluated=pricer.evaluated,
        valid=pricer.valid,
        fitting=pricer.fitting,
        timed=len(pricer.timed),
        seconds=time.perf_counter() - started,
        results=[found[candidate] for _, _, candidate in timed[: space.limit]],
        pareto=[found[candidate] for _, _, candidate in front],
        message=None if timed else pricer.why_nothing_fits(),
    )


def frontier(timed: list[tuple[float, float, Candidate]]) -> list[tuple[float, float, Candidate]]:
    """The (peak bytes, step seconds, layout) that no other beats on both counts, by memory."""
    front: list[tuple[float, float, Candidate]] = []
    for peak, step_s, candidate in sorted(timed, key=lambda item: item[:2]):
        if not front or step_s < front[-1][1]:
            front.append((peak, step_s, candidate))
    return front


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def fully_shards(candidate: Candidate) -> bool:
    """ParallelConfig.fully_shards of the candidate's layout, without building it."""
    data = candidate.data
    if data.dp_replicate > 1:
        world = candidate.tp * candidate.cp * candidate.pp * data.dp_replicate * data.dp_shard
        return world != data.dp_replicate
    return data.dp_shard * candidate.cp > 1


@dataclass
class SearchSpace:
    """The validated inputs, and the choices along each axis that trainer/config.py accepts.

    Each rule in `cross_section_errors` reads, besides the model, the tensor and context fields
    (tp, sequence_parallel, cp), the data-parallel ones (cp, dp_replicate, dp_shard, zero_stage,
    ep) or the pipeline ones (pp, schedule, stages_per_rank, microbatches, micro_batch): a layout
    is valid when its three parts are, so each part is checked once, on the validated base config
    with only that part changed. `Pricer.found` validates each returned layout whole, so a rule
    that comes to read across parts is noticed rather than missed."""

    base: RunConfig
    cluster: ClusterSpec
    gpus: int
    global_batch: int
    limit: int
    runnable_only: bool = False
    """Whether the rules include `unrunnable_errors`: only layouts loom's trainer runs."""
    _accepted: dict = field(default_factory=dict)
    _data_choices: dict = field(default_factory=dict)
    _pipeline_choices: dict = field(default_factory=dict)
    _sections: dict = field(default_factory=dict)
    _data_sections: dict = field(default_factory=dict)

    @classmethod
    def parse(
        cls,
        model: object,
        cluster: object,
        global_batch: object,
        seq_len: object,
        precision: object,
        limit: object,
        gpus: object,
        runnable_only: object = False,
    ) -> SearchSpace:
        """The search's inputs validated, every bad one named at once in a ConfigError."""
        errors: dict[str, str] = {}
        if not _is_count(global_batch):
            errors["global_batch"] = "must be a whole number of sequences, at least 1"
        if not _is_count(limit):
            errors["limit"] = "must be a whole number of layouts, at least 1"
        if seq_len is not None and not _is_count(seq_len):
            errors["seq_len"] = "must be a whole number of tokens, at least 1, or null for the model's own"
        if not isinstance(runnable_only, bool):
            errors["runnable_only"] = "must be true (only layouts loom's trainer runs) or false (every layout)"
        if not isinstance(model, dict):
            errors["model"] = 'must be a JSON object: a preset ({"preset": "llama3-70b"}) or the model\'s fields'
            model = {}
        if seq_len is not None and "seq_len" not in errors:
            model = {**model, "seq_len": seq_len}
        base = cluster_spec = None
        try:
            base, cluster_spec = parse_plan({"model": model, "compute": {"precision": precision}}, cluster)
        except ConfigError as error:
            errors |= {
                ("precision" if key == "compute.precision" else key): message for key, message in error.errors.items()
            }
        if cluster_spec is not None and gpus is not None and not (_is_count(gpus) and gpus <= cluster_spec.world_size):
            errors["gpus"] = f"must be a whole number from 1 to the cluster's {cluster_spec.world_size}; null: all"
        if errors:
            raise ConfigError(errors)
        return cls(base, cluster_spec, gpus or cluster_spec.world_size, global_batch, limit, runnable_only)

    def _accepts(self, parallel: dict, micro_batch: int = 1) -> bool:
        """Whether the base config with this parallel section and micro-batch passes the field
        rules of those sections and every cross-section rule, and with runnable_only whether the
        trainer runs it (the rest was validated once)."""
        key = (tuple(parallel.items()), micro_batch)
        if key not in self._accepted:
            try:
                sections = {
                    "parallel": ParallelConfig.model_validate(parallel),
                    "data": self._data_section(micro_batch),
                }
            except ValidationError:
                self._accepted[key] = False
            else:
                config = self.base.model_copy(update=sections)
                self._accepted[key] = not cross_section_errors(config) and not (
                    self.runnable_only and unrunnable_errors(config)
                )
        return self._accepted[key]

    def _data_section(self, micro_batch: int) -> DataConfig:
        if micro_batch not in self._data_sections:
            self._data_sections[micro_batch] = DataConfig.model_validate(
                {**self.base.data.model_dump(), "micro_batch": micro_batch}
            )
        return self._data_sections[micro_batch]

    def layouts_of_world(self):
        """(tp, cp, pp, dp, micro_batch) that use every GPU and split the global batch evenly."""
        for tp in divisors(self.gpus):
            if tp > self.cluster.gpus_per_node:
                continue
            for cp in divisors(self.gpus // tp):
                for pp in divisors(self.gpus // (tp * cp)):
                    dp = self.gpus // (tp * cp * pp)
                    if self.global_batch % dp == 0:
                        yield tp, cp, pp, dp, self.global_batch // dp

    def data_choices(self, tp: int, cp: int, dp: int) -> tuple[int, list[DataChoice]]:
        """(how many were tried, the valid ones) over dp data-parallel ranks, for tp × cp."""
        key = (tp, cp, dp)
        if key not in self._data_choices:
            expert_degrees = divisors(self.base.model.experts)
            tried = [
                DataChoice(dp // shard, shard, zero, ep, reshard)
                for shard in divisors(dp)
                for zero in ZERO_STAGES
                for reshard in ((True, False) if zero == 3 else (True,))
                for ep in expert_degrees
            ]
            tensor = {"tp": tp, "sequence_parallel": tp > 1, "cp": cp}
            # With tp, since the trainer runs a mixture of experts under tensor or expert parallelism, not both.
            valid = [choice for choice in tried if self._accepts(tensor) and self._accepts(tensor | choice._asdict())]
            self._data_choices[key] = (len(tried), valid)
        return self._data_choices[key]

    def pipeline_choices(self, pp: int, micro_batch: int) -> tuple[int, dict[tuple[str, int], list[int]]]:
        """(how many were tried, {(schedule, stages_per_rank): valid microbatch counts, most first})."""
        key = (pp, micro_batch)
        if key not in self._pipeline_choices:
            tried = list(self._pipeline_candidates(pp, micro_batch))
            valid: dict[tuple[str, int], list[int]] = {}
            for choice in sorted(tried, key=lambda choice: -choice.microbatches):
                if self._pipeline_valid(pp, micro_batch, choice):
                    valid.setdefault(choice[:2], []).append(choice.microbatches)
            self._pipeline_choices[key] = (len(tried), valid)
        return self._pipeline_choices[key]

    def _pipeline_candidates(self, pp: int, micro_batch: int):
        if pp == 1:
            yield PipelineChoice("1F1B", 1, 1)
            return
        layers = self.base.model.layers
        counts = divisors(micro_batch)
        for schedule in PIPELINE_SCHEDULES:
            if schedule in ONE_STAGE_SCHEDULES:
                looping = [1]
            elif schedule in V_SCHEDULES:
                looping = [2]
            else:
                looping = [v for v in range(2, 65) if splits(layers, pp * v)]
            for stages_per_rank in looping:
                for microbatches in counts:
                    yield PipelineChoice(schedule, stages_per_rank, microbatches)

    def _pipeline_valid(self, pp: int, micro_batch: int, choice: PipelineChoice) -> bool:
        return self._accepts(
            {
                "pp": pp,
                "pp_schedule": choice.schedule,
                "stages_per_rank": choice.stages_per_rank,
                "microbatches": choice.microbatches,
            },
            micro_batch,
        )

    def config(self, candidate: Candidate) -> RunConfig:
        """The candidate as a run config, built from the validated base without validating again."""
        pipeline = candidate.pipeline
        parallel = self.base.parallel.model_copy(
            update={
                "tp": candidate.tp,
                "sequence_parallel": candidate.tp > 1,
                "cp": candidate.cp,
                "pp": candidate.pp,
                "pp_schedule": pipeline.schedule,
                "stages_per_rank": pipeline.stages_per_rank,
                "microbatches": pipeline.microbatches,
                **candidate.data._asdict(),
            }
        )
        sections = (candidate.micro_batch, candidate.recompute)
        if sections not in self._sections:
            self._sections[sections] = {
                "data": self.base.data.model_copy(update={"micro_batch": candidate.micro_batch}),
                "compute": self.base.compute.model_copy(update={"recompute": candidate.recompute}),
            }
        return self.base.model_copy(update={"parallel": parallel, **self._sections[sections]})


@dataclass(frozen=True)
class Placement:
    """What each pipeline rank holds under one schedule and stage count."""

    holdings: list[RankHolding]
    signatures: tuple
    """Every rank's signature, in rank order."""
    distinct: list[int]
    """One rank of each signature: all that time needs, as ranks alike take as long."""
    alike: list[list[int]]
    """The ranks of each signature, in the order of `distinct`: ranks alike hold the same model states, so
    the fullest of them is the one with most activations."""

    @cached_property
    def alike_order(self) -> list[int]:
        """Every rank, those alike together (for np.maximum.reduceat at `alike_starts`)."""
        return [rank for ranks in self.alike for rank in ranks]

    @cached_property
    def alike_starts(self) -> list[int]:
        return [sum(len(ranks) for ranks in self.alike[:index]) for index in range(len(self.alike))]


class HeldByRank(NamedTuple):
    """What the pipeline ranks of one placement hold under each of some pipeline choices."""

    layers: np.ndarray
    """[kind of block (`block_kinds`), rank]"""
    in_flight: np.ndarray
    """[pipeline choice, rank]: microbatches whose activations the rank holds at its peak."""
    output_ranks: list[int]
    """The ranks that compute the loss."""
    micro_seqs: np.ndarray
    """[pipeline choice, 1]: sequences in a microbatch."""


@dataclass(frozen=True)
class StateTable:
    """What one stage placement's data choices hold besides activations, as arrays over the choices."""

    choices: list[DataChoice]
    state_bytes: np.ndarray
    """[choice, signature]: `model_state_terms` + `buffer_terms` of the ranks of each signature."""
    optimizer_s: np.ndarray
    fills: list[tuple | None]
    """For one replica on one stage, what `gradients_at_the_peak` needs; None otherwise."""
    sharded: np.ndarray
    """Whether the layout fully shards (FSDP holds the parameters)."""
    outside: np.ndarray
    """The CUDA context and NCCL buffers."""
    eps: np.ndarray

    @property
    def filled(self) -> list[int]:
        return [row for row, fill in enumerate(self.fills) if fill]


@dataclass(frozen=True)
class PlacementLayouts:
    """One stage placement of (tp, cp, pp, micro_batch): every valid pipeline choice that places the stages so
    (schedule and microbatch count) and every valid data choice, under every recompute mode."""

    leanest: Candidate
    """The first pipeline choice, the first data choice and full recompute."""
    pipelines: list[PipelineChoice]
    states: StateTable

    @cached_property
    def schedule_index(self) -> np.ndarray:
        """Each pipeline choice's schedule, numbered."""
        schedules = {pipeline.schedule: index for index, pipeline in enumerate(self.pipelines)}
        return np.array([schedules[pipeline.schedule] for pipeline in self.pipelines])

    def candidate(self, mode: int, pipeline: int, choice: DataChoice) -> Candidate:
        tp, cp, pp, _, _, _, micro_batch = self.leanest
        return Candidate(tp, cp, pp, self.pipelines[pipeline], choice, RECOMPUTE_LEANEST_FIRST[mode], micro_batch)


@dataclass
class Fitting:
    """Every fitting layout as parallel arrays: its peak bytes, a lower bound on its step time, and where it
    is (stage placement, recompute mode, pipeline choice, data choice); a layout is built only when needed."""

    placements: list[PlacementLayouts] = field(default_factory=list)
    peak: np.ndarray | list = field(default_factory=list)
    bound: np.ndarray | list = field(default_factory=list)
    placement: np.ndarray | list = field(default_factory=list)
    mode: np.ndarray | list = field(default_factory=list)
    pipeline: np.ndarray | list = field(default_factory=list)
    row: np.ndarray | list = field(default_factory=list)
    size: int = 0

    def __len__(self) -> int:
        return self.size

    def add(self, placed: PlacementLayouts, mode: int, peaks, bounds, pipelines, rows) -> None:
        if not self.placements or self.placements[-1] is not placed:
            self.placements.append(placed)
        self.peak.append(peaks)
        self.bound.append(bounds)
        self.placement.append(np.full(len(rows), len(self.placements) - 1))
        self.mode.append(np.full(len(rows), mode))
        self.pipeline.append(pipelines)
        self.row.append(rows)
        self.size += len(rows)

    def concatenated(self) -> Fitting:
        def join(parts, dtype):
            return np.concatenate(parts) if parts else np.empty(0, dtype)

        return Fitting(
            self.placements,
            join(self.peak, float),
            join(self.bound, float),
            join(self.placement, int),
            join(self.mode, int),
            join(self.pipeline, int),
            join(self.row, int),
            self.size,
        )

    def candidate(self, index: int) -> Candidate:
        placed = self.placements[self.placement[index]]
        return placed.candidate(
            int(self.mode[index]), int(self.pipeline[index]), placed.states.choices[self.row[index]]
        )


def first_below(values: np.ndarray, start: int, limit: float) -> int:
    """The first index from `start` whose value is below `limit`, or len(values); it looks ahead in growing chunks."""
    chunk = 64
    while start < len(values):
        hits = np.flatnonzero(values[start : start + chunk] < limit)
        if hits.size:
            return start + int(hits[0])
        start += chunk
        chunk *= 2
    return len(values)


class Pricer:
    """Memory and step time of layouts, from parts shared between layouts (see the module docstring).

    Each cache is keyed by what the planner function it wraps reads of the layout."""

    def __init__(self, space: SearchSpace):
        self.space = space
        self.cluster = space.cluster
        self.capacity = space.cluster.gpu_type.memory_bytes
        self.tokens_per_step = space.global_batch * space.base.model.seq_len
        self.model_flops_per_step = model_flops_per_token(space.base.model) * self.tokens_per_step
        self.evaluated = self.valid = self.fitting = 0
        self.leanest: tuple[float, Candidate] | None = None
        self.timed: dict[Candidate, tuple[float, float]] = {}
        self._placements: dict = {}
        self._rank_elements: dict = {}
        self._states: dict = {}
        self._data_states_of: dict = {}
        self._held: dict = {}
        self._layer_activations: dict = {}
        self._logits: dict = {}
        self._buffers: dict = {}
        self._compute: dict = {}
        self._blocks: dict = {}
        self._bubbles: dict = {}
        self._groups: dict = {}
        self._data_parallel_traffic: dict = {}
        self._data_parallel_of: dict = {}
        self._fewest_microbatches_busy: dict = {}
        self._pipeline_s: dict = {}
        self._outside: dict = {}

    def _layout(self, candidate: Candidate) -> Layout:
        return Layout(self.space.config(candidate))

    # ---- structure ----

    def _placement(self, candidate: Candidate) -> Placement:
        pipeline = candidate.pipeline
        key = (candidate.pp, pipeline.stages_per_rank, pipeline.schedule in V_SCHEDULES)
        if key not in self._placements:
            parallel = self.space.config(candidate).parallel
            holdings = [rank_holding(self.space.base.model, parallel, rank) for rank in range(candidate.pp)]
            alike: dict[tuple, list[int]] = {}
            for rank, held in enumerate(holdings):
                alike.setdefault(held.signature, []).append(rank)
            self._placements[key] = Placement(
                holdings,
                tuple(held.signature for held in holdings),
                [ranks[0] for ranks in alike.values()],
                list(alike.values()),
            )
        return self._placements[key]

    def _holding(self, candidate: Candidate, rank: int) -> RankHolding:
        return self._placement(candidate).holdings[rank]

    # ---- memory ----

    def _outside_allocator_bytes(self, candidate: Candidate) -> float:
        """The CUDA context and NCCL buffers, which take from the GPU what the allocator cannot."""
        data = candidate.data
        key = (candidate.tp, candidate.cp, candidate.pp, data.dp_replicate, data.dp_shard, data.ep)
        if key not in self._outside:
            self._outside[key] = total(outside_allocator_terms(*key))
        return self._outside[key]

    def price_memory(self) -> Fitting:
        """Peak device bytes and a lower bound on the step time of every fitting layout."""
        fitting = Fitting()
        for tp, cp, pp, dp, micro_batch in self.space.layouts_of_world():
            data_tried, data = self.space.data_choices(tp, cp, dp)
            pipeline_tried, pipelines = self.space.pipeline_choices(pp, micro_batch)
            self.evaluated += data_tried * pipeline_tried * len(RECOMPUTE_LEANEST_FIRST)
            self.valid += len(data) * sum(len(counts) for counts in pipelines.values()) * len(RECOMPUTE_LEANEST_FIRST)
            if not data:
                continue
            # Schedules that place the stages alike share the model states and price their activations together.
            placed_alike: dict[tuple, list[PipelineChoice]] = {}
            for (schedule, stages_per_rank), counts in pipelines.items():
                placed_alike.setdefault((stages_per_rank, schedule in V_SCHEDULES), []).extend(
                    PipelineChoice(schedule, stages_per_rank, microbatches) for microbatches in counts
                )
            for pipelines_alike in placed_alike.values():
                leanest = Candidate(tp, cp, pp, pipelines_alike[0], data[0], "full", micro_batch)
                self._price_placement(
                    PlacementLayouts(leanest, pipelines_alike, self._data_states(leanest, data)), fitting
                )
        self.fitting = len(fitting)
        return fitting.concatenated()

    def _price_placement(self, placed: PlacementLayouts, fitting: Fitting) -> None:
        """Every recompute mode, pipeline choice and data choice of one stage placement at once, leanest mode
        first: where nothing fits under one mode, nothing fits under the modes that keep more."""
        states = placed.states
        leanest = placed.leanest
        bubbles = np.array([self._bubble(leanest._replace(pipeline=pipeline)) for pipeline in placed.pipelines])
        one_pass = self.space.global_batch // leanest.micro_batch == 1
        for mode, recompute in enumerate(RECOMPUTE_LEANEST_FIRST):
            moded = leanest._replace(recompute=recompute)
            peaks = np.empty((len(placed.pipelines), len(states.choices)))
            # The residual stream's dtype, and so the activations, depend on whether FSDP holds the parameters.
            activations_if_sharded = {}
            for sharded in (False, True):
                rows = np.flatnonzero(states.sharded == sharded)
                if rows.size:
                    activations = self._activation_bytes(moded._replace(data=states.choices[rows[0]]), placed.pipelines)
                    activations_if_sharded[sharded] = activations
                    held = states.state_bytes[rows][np.newaxis] + activations[:, np.newaxis]
                    peaks[:, rows] = reserved_bytes(held.max(axis=2))
            if one_pass:
                for row in states.filled:
                    # One replica, one pass, one stage: the gradients fill in as backward frees the activations.
                    (activation,) = activations_if_sharded[bool(states.sharded[row])][0]
                    (held,), (gradients, copies, first) = states.state_bytes[row], states.fills[row]
                    at_peak = gradients_held_at_the_peak(gradients, activation + copies, first)
                    peaks[0, row] = reserved_bytes(held - gradients + at_peak + activation)
            device = peaks + states.outside
            fits = device <= self.capacity
            if not fits.any():
                pipeline, row = np.unravel_index(np.argmin(device), device.shape)
                if self.leanest is None or device[pipeline, row] < self.leanest[0]:
                    self.leanest = (float(device[pipeline, row]), placed.candidate(mode, pipeline, states.choices[row]))
                return
            pipelines, rows = np.nonzero(fits)
            # Before any communication that compute may hide is priced: a lower bound.
            bounds = step_seconds(
                pipeline_seconds(self._fewest_busy(placed, moded, pipelines, rows), bubbles[pipelines]),
                0.0,
                0.0,
                states.optimizer_s[rows],
            )
            fitting.add(placed, mode, peaks[pipelines, rows], bounds, pipelines, rows)

    def _fewest_busy(
        self, placed: PlacementLayouts, moded: Candidate, pipelines: np.ndarray, rows: np.ndarray
    ) -> np.ndarray:
        """`_fewest_microbatches_busy_s` of these layouts of the placement (pipeline and data choice indices),
        computed once per schedule and ep."""
        eps = placed.states.eps[rows]
        schedules = placed.schedule_index[pipelines]
        busy = np.empty(len(rows))
        for schedule, ep in set(zip(schedules.tolist(), eps.tolist(), strict=True)):
            alike = (schedules == schedule) & (eps == ep)
            first = int(np.argmax(alike))
            candidate = moded._replace(
                pipeline=placed.pipelines[pipelines[first]], data=placed.states.choices[rows[first]]
            )
            busy[alike] = self._fewest_microbatches_busy_s(candidate)
        return busy

    def _data_states(self, candidate: Candidate, data: list[DataChoice]) -> StateTable:
        """Each data choice's model states per rank signature, optimizer seconds, what the gradients at the
        peak need, whether it fully shards and the bytes outside the allocator."""
        key = (candidate.tp, candidate.cp, candidate.pp, self._placement(candidate).signatures, tuple(data))
        if key not in self._data_states_of:
            states = [self._states_of(candidate, choice) for choice in data]
            layouts = [candidate._replace(data=choice) for choice in data]
            self._data_states_of[key] = StateTable(
                data,
                np.array([state_bytes for state_bytes, _, _ in states]),
                np.array([optimizer_s for _, optimizer_s, _ in states]),
                [fill for _, _, fill in states],
                np.array([fully_shards(layout) for layout in layouts]),
                np.array([self._outside_allocator_bytes(layout) for layout in layouts]),
                np.array([choice.ep for choice in data]),
            )
        return self._data_states_of[key]

    def _states_of(self, candidate: Candidate, choice: DataChoice) -> tuple[list[float], float, tuple | None]:
        """`model_state_terms` + `buffer_terms` per rank signature (`Placement.distinct`), `optimizer_seconds` of
        the rank that updates most parameters (as `optimizer_term` takes it), and for one replica on one stage what
        `gradients_at_the_peak` needs, of the candidate with this data choice."""
        key = (
            self._placement(candidate).signatures,
            candidate.tp,
            choice.ep,
            choice.zero_stage,
            choice.dp_shard * candidate.cp,
            choice.reshard_after_forward,
            choice.dp_replicate * choice.dp_shard > 1,
        )
        if key not in self._states:
            candidate = candidate._replace(data=choice)
            layout = self._layout(candidate)
            by_signature = {}
            fill = None
            placement = self._placement(candidate)
            for rank in placement.distinct:
                elements = self._elements_of(candidate, rank)
                terms = model_state_terms(layout, elements) + buffer_terms(layout, rank, elements)
                state_bytes = total(terms)
                by_signature[self._holding(candidate, rank).signature] = (state_bytes, elements.optimizer)
                if one_replica_one_stage(layout.parallel):
                    # `gradients_at_the_peak`'s parts: the gradients, what else backward frees besides the
                    # activations (the autocast copies), the output layer's gradients.
                    gradients = sum(term.value for term in terms if term.name == "gradients")
                    copies = sum(term.value for term in terms if term.name in FREED_IN_BACKWARD)
                    fill = (gradients, copies, output_layer_gradient_bytes(layout))
            optimizer_s = optimizer_seconds(
                max(optimizer for _, optimizer in by_signature.values()), layout, self.cluster
            )
            state_bytes = [by_signature[self._holding(candidate, rank).signature][0] for rank in placement.distinct]
            self._states[key] = (state_bytes, optimizer_s, fill)
        return self._states[key]

    def _elements_of(self, candidate: Candidate, rank: int) -> StateElements:
        """`state_elements` of the rank's tensors, which depend on its signature and on how tp, ep,
        the sharding ranks and the ZeRO stage cut them."""
        data = candidate.data
        held = self._holding(candidate, rank)
        key = (held.signature, candidate.tp, data.ep, data.dp_shard * candidate.cp, data.zero_stage)
        if key not in self._rank_elements:
            self._rank_elements[key] = state_elements(self._layout(candidate), held.tensors)
        return self._rank_elements[key]

    def _activation_bytes(self, candidate: Candidate, pipelines: list[PipelineChoice]) -> np.ndarray:
        """`activation_terms` (per layer, times the layers and microbatches in flight, plus the logits) +
        `pipeline_buffer_term` of the rank of each signature that keeps most (`Placement.alike`), under each of
        these pipeline choices of the candidate's placement: [pipeline choice, signature]. A microbatch keeps b
        times what one sequence keeps, and a rank's activations depend on it only through its layers, whether it
        computes the loss and its microbatches in flight (and, for the residual stream's dtype, whether FSDP
        holds the parameters)."""
        tp, cp, pp, pipeline, _, recompute, micro_batch = candidate
        one_sequence = None
        buffers_key = (pp, tp, cp, pipeline.stages_per_rank)
        if buffers_key not in self._buffers:
            one_sequence = self._layout(candidate._replace(micro_batch=pipeline.microbatches))
            self._buffers[buffers_key] = total(pipeline_buffer_term(one_sequence))
        # Whether the loss is chunked (Layout.fused_loss) and whether FSDP holds the parameters.
        fused_loss = tp == 1 or self.space.base.parallel.loss_parallel
        same = (tp, cp, recompute, fused_loss, fully_shards(candidate))
        if same not in self._layer_activations:
            one_sequence = one_sequence or self._layout(candidate._replace(micro_batch=pipeline.microbatches))
            self._layer_activations[same] = np.array(
                [
                    [layer_activation_bytes(one_sequence.with_blocks(kind.model))]
                    for kind in block_kinds(self.space.base.model)
                ]
            )
        held = self._held_by_rank(candidate, pipelines)
        per_microbatch = (self._layer_activations[same] * held.layers).sum(axis=0)
        kept = per_microbatch * held.in_flight
        for rank in held.output_ranks:
            for index, in_flight in enumerate(held.in_flight[:, rank].tolist()):
                key = same + (pp == 1, in_flight)
                if key not in self._logits:
                    one_sequence = one_sequence or self._layout(candidate._replace(micro_batch=pipeline.microbatches))
                    self._logits[key] = logits_term(one_sequence, in_flight).value
                kept[index, rank] += self._logits[key]
        per_rank = held.micro_seqs * (kept + self._buffers[buffers_key])
        placement = self._placement(candidate)
        return np.maximum.reduceat(per_rank[:, placement.alike_order], placement.alike_starts, axis=1)

    def _held_by_rank(self, candidate: Candidate, pipelines: list[PipelineChoice]) -> HeldByRank:
        key = (candidate.pp, candidate.micro_batch, tuple(pipelines))
        if key not in self._held:
            holdings = self._placement(candidate).holdings
            in_flight = []
            for pipeline in pipelines:
                layout = self._layout(candidate._replace(pipeline=pipeline))
                in_flight.append([in_flight_microbatches(layout, rank) for rank in range(candidate.pp)])
            self._held[key] = HeldByRank(
                np.array(
                    [[held.layers_like(kind) for held in holdings] for kind in block_kinds(self.space.base.model)],
                    dtype=float,
                ),
                np.array(in_flight, dtype=float),
                [rank for rank, held in enumerate(holdings) if held.holds_output],
                np.array([[candidate.micro_batch // pipeline.microbatches] for pipeline in pipelines], dtype=float),
            )
        return self._held[key]

    # ---- time ----

    def _rank_compute(self, candidate: Candidate, rank: int) -> RankCompute:
        """`stages_compute` of the rank's stages. It reads of the layout what the rank holds (its
        signature, and whether a tied output has a copy of its own: more than one stage), the
        recompute mode, tp, cp, ep (the tokens each local expert's products take) and the sequences in a
        microbatch."""
        held = self._holding(candidate, rank)
        one_stage = candidate.pp * candidate.pipeline.stages_per_rank == 1
        micro_seqs = candidate.micro_batch // candidate.pipeline.microbatches
        key = (
            held.signature,
            one_stage,
            candidate.recompute,
            candidate.tp,
            candidate.cp,
            candidate.data.ep,
            micro_seqs,
        )
        if key not in self._compute:
            layout = self._layout(candidate)

            def block_of(kind_layout: Layout) -> BlockCompute:
                # A kind of block's kernels are the same for every rank, recompute mode and stage placement.
                block_key = (candidate.tp, candidate.cp, candidate.data.ep, micro_seqs, kind_layout.model.experts)
                if block_key not in self._blocks:
                    self._blocks[block_key] = block_compute(kind_layout, self.cluster)
                return self._blocks[block_key]

            self._compute[key] = stages_compute(layout, self.cluster, held.stages, block_of)
        return self._compute[key]

    def _bubble(self, candidate: Candidate) -> float:
        if candidate.pp == 1:
            return 0.0
        key = (candidate.pp, candidate.pipeline)
        if key not in self._bubbles:
            pipeline = candidate.pipeline
            self._bubbles[key] = closed_form_bubble(
                pipeline.schedule, candidate.pp, pipeline.microbatches, pipeline.stages_per_rank
            )
        return self._bubbles[key]

    def _rank_times(self, layout: Layout, candidate: Candidate) -> list[RankTime]:
        """`rank_time` of one pipeline rank of each signature."""
        return [
            rank_time_from(
                layout,
                self.cluster,
                rank,
                self._holding(candidate, rank),
                self._rank_compute(candidate, rank),
                self._elements_of(candidate, rank).unsharded,
            )
            for rank in self._placement(candidate).distinct
        ]

    @staticmethod
    def _busiest_s(candidate: Candidate, ranks: list[RankTime]) -> float:
        return max(rank.busy_s(candidate.pipeline.microbatches) for rank in ranks)

    def _fewest_microbatches_busy_s(self, candidate: Candidate) -> float:
        """The busiest rank's compute and in-layer communication at the placement's fewest
        microbatches: no more microbatches of the same batch make either shrink (the same FLOPs,
        more collectives of the same bytes), so it bounds every microbatch count's from below.
        Schedules whose ranks hold the same share it."""
        tp, cp, pp, pipeline, data, recompute, micro_batch = candidate
        line = (tp, cp, pp, pipeline.schedule, pipeline.stages_per_rank, recompute, micro_batch, data.ep)
        if line not in self._fewest_microbatches_busy:
            _, pipelines = self.space.pipeline_choices(pp, micro_batch)
            fewest = candidate._replace(pipeline=pipeline._replace(microbatches=pipelines[pipeline[:2]][-1]))
            shared = (
                tp,
                cp,
                pp,
                recompute,
                micro_batch,
                fewest.pipeline.microbatches,
                data.ep,
                self._placement(fewest).signatures,
            )
            if shared not in self._fewest_microbatches_busy:
                ranks = self._rank_times(self._layout(fewest), fewest)
                self._fewest_microbatches_busy[shared] = self._busiest_s(fewest, ranks)
            self._fewest_microbatches_busy[line] = self._fewest_microbatches_busy[shared]
        return self._fewest_microbatches_busy[line]

    def _pipeline_key(self, candidate: Candidate) -> tuple:
        """The pipeline's part of the step depends on everything but the data-parallel split and
        ZeRO stage (ep, which sizes the expert all-to-alls, stays); with tied embeddings across
        stages on them too, which size the shards of the gradients the first and the last stage
        all-reduce."""
        tp, cp, pp, pipeline, data, recompute, micro_batch = candidate
        if self.space.base.model.tie_embeddings and pp > 1:
            return tp, cp, pp, pipeline, recompute, micro_batch, data
        return tp, cp, pp, pipeline, recompute, micro_batch, data.ep

    def _pipeline_part_s(self, candidate: Candidate) -> tuple[float, float]:
        """`pipeline_seconds` and the exposed pipeline traffic: the same for every data-parallel split
        that `_pipeline_key` leaves out."""
        key = self._pipeline_key(candidate)
        if key not in self._pipeline_s:
            ranks = self._rank_times(self._layout(candidate), candidate)
            self._pipeline_s[key] = (
                pipeline_seconds(self._busiest_s(candidate, ranks), self._bubble(candidate)),
                most_exposed_s(ranks, ("pp",)),
            )
        return self._pipeline_s[key]

    def _data_parallel_s(self, candidate: Candidate) -> float:
        """The exposed data-parallel communication of the rank that exposes most. It depends on the
        stage placement only through what the ranks hold, which many schedules share."""
        tp, cp, pp, pipeline, data, recompute, micro_batch = candidate
        key = (tp, cp, pp, pipeline.microbatches, data, recompute, micro_batch, self._placement(candidate).signatures)
        if key not in self._data_parallel_of:
            self._data_parallel_of[key] = max(
                self._data_parallel_exposed_s(candidate, rank) for rank in self._placement(candidate).distinct
            )
        return self._data_parallel_of[key]

    def _data_parallel_exposed_s(self, candidate: Candidate, rank: int) -> float:
        """The rank's exposed data-parallel communication as `step_traffic` and `expose` time it.
        The traffic does not depend on the recompute mode (what of it compute hides does), nor on the microbatch
        count unless FSDP gathers the parameters again for every microbatch (ZeRO-3, resharding after forward)."""
        held = self._holding(candidate, rank)
        data = candidate.data
        regathers = data.zero_stage == 3 and data.reshard_after_forward
        key = (
            candidate.tp,
            candidate.cp,
            candidate.pp,
            candidate.pipeline.microbatches if regathers else None,
            data,
            held.signature,
        )
        if key not in self._data_parallel_traffic:
            layout = self._layout(candidate)
            parallel = layout.parallel
            groups_key = (parallel.tp, parallel.cp, parallel.dp_shard, parallel.dp_replicate, parallel.pp, parallel.ep)
            if groups_key not in self._groups:
                self._groups[groups_key] = groups(layout)
            traffic = data_parallel_traffic(
                layout,
                self._groups[groups_key],
                self.cluster.gpus_per_node,
                self._elements_of(candidate, rank).unsharded,
                layout.compute_bytes,
                expert_elements(layout, self._holding(candidate, rank).tensors),
            )
            time_traffic(traffic, self.cluster)
            self._data_parallel_traffic[key] = traffic
        traffic = self._data_parallel_traffic[key]
        compute = self._rank_compute(candidate, rank)
        expose(traffic, compute.forward_s, compute.backward_s, held.layers, candidate.pp)
        return sum(item.exposed_s for item in traffic)

    def _tighter_bound(self, candidate: Candidate, bound_s: float, exactness: int) -> tuple[float, int]:
        """The next lower bound on the step time after `bound_s` of this exactness; exact, the step
        time `step_seconds` adds up. The data-parallel part is cheap and is added to the first bound;
        the pipeline's part is dear unless a layout that shares it was timed, and comes last."""
        data_parallel_s = self._data_parallel_s(candidate)
        if exactness == FEWEST_MICROBATCHES_BOUND and self._pipeline_key(candidate) not in self._pipeline_s:
            return bound_s + data_parallel_s, DATA_PARALLEL_BOUND
        pipeline_s, pipeline_p2p_s = self._pipeline_part_s(candidate)
        optimizer_s = self._states_of(candidate, candidate.data)[1]
        step_s = step_seconds(pipeline_s, data_parallel_s, pipeline_p2p_s, optimizer_s)
        self.timed[candidate] = (step_s, self._bubble(candidate))
        return step_s, EXACT

    def time_what_matters(self, fitting: Fitting) -> list[tuple[float, float, Candidate]]:
        """(peak bytes, step seconds, layout) of the fitting layouts that are among the `limit`
        fastest or on the frontier (and a few more), fastest first, each timed exactly.

        Best first: the layout with the least bound on its step time is taken from the queue, its
        bound tightened and the layout put back, until the bound taken is exact. Layouts leave the
        queue fastest first, so one that leaves after `limit` others, with no less memory than one of
        them, is beaten on both counts and is dropped before any more of its time is computed (and
        since that least memory only falls, such layouts are skipped in bulk)."""
        # The first bounds, sorted once, merge with a heap of the tightened ones: the same order as one heap of
        # everything, (bound, position in `fitting`), without pushing every layout through it.
        first = np.argsort(fitting.bound, kind="stable")
        first_peaks = fitting.peak[first]
        first_bounds, first, peaks = fitting.bound[first].tolist(), first.tolist(), fitting.peak.tolist()
        tightened: list[tuple[float, int, int]] = []
        fastest: list[tuple[float, float, Candidate]] = []
        built: dict[int, Candidate] = {}
        least_memory = float("inf")
        index = 0
        while index < len(first) or tightened:
            if len(fastest) >= self.space.limit and index < len(first) and peaks[first[index]] >= least_memory:
                index = first_below(first_peaks, index, least_memory)
            if tightened and (index == len(first) or tightened[0][:2] < (first_bounds[index], first[index])):
                step_s, order, exactness = heapq.heappop(tightened)
            elif index < len(first):
                order, exactness, step_s = first[index], FEWEST_MICROBATCHES_BOUND, first_bounds[index]
                index += 1
            else:
                break
            peak = peaks[order]
            if len(fastest) >= self.space.limit and peak >= least_memory:
                continue
            candidate = built.get(order) or built.setdefault(order, fitting.candidate(order))
            if exactness == EXACT:
                fastest.append((peak, step_s, candidate))
                least_memory = min(least_memory, peak)
            else:
                bound, exactness = self._tighter_bound(candidate, step_s, exactness)
                heapq.heappush(tightened, (bound, order, exactness))
        return fastest

    def found(self, peak: float, candidate: Candidate) -> Found:
        """The timed layout with its config, validated whole as a launch would validate it: the
        per-part checks must agree."""
        step_s, bubble = self.timed[candidate]
        try:
            config = parse_config(
                self.space.config(candidate).model_dump(mode="json"), runnable=self.space.runnable_only
            )
        except ConfigError as error:
            raise RuntimeError(
                f"the search produced a layout the rules refuse ({summarize(candidate)}): {error}; "
                "SearchSpace's per-part checks no longer match trainer/config.py"
            ) from None
        peak_flops = self.space.gpus * self.cluster.gpu_type.peak_bf16_flops
        return Found(
            candidate,
            config,
            self.tokens_per_step / step_s,
            self.model_flops_per_step / (step_s * peak_flops),
            step_s,
            peak,
            bubble,
        )

    def why_nothing_fits(self) -> str:
        gpus = f"{self.space.gpus} × {self.cluster.gpu}"
        if self.leanest is None:
            return (
                f"no layout of {gpus} is valid at a global batch of {self.space.global_batch}: it must split "
                "evenly over the data-parallel ranks and the model's heads, layers and sequence over tp, pp and cp"
            )
        peak, candidate = self.leanest
        valid = "runnable" if self.space.runnable_only else "valid"
        return (
            f"none of the {self.valid:,} {valid} layouts of {gpus} fits in {self.capacity / GIB:.1f} GiB per GPU; "
            f"the leanest ({summarize(candidate)}) needs {peak / GIB:.0f} GiB with the CUDA context and NCCL's "
            "buffers: use more GPUs, a smaller model or a shorter sequence"
        )
