"""One layout's estimate: memory per pipeline rank, step time and its parts, communication,
throughput and MFU, warnings — every number with the terms it came from.

A step of a global batch larger than one pass (micro_batch × data-parallel ranks) runs
accumulation_steps passes: each pass its compute, in-layer communication and pipeline bubble; the
data-parallel reduction and the optimizer once (communication.py). Memory is one pass's: passes run
one after another, and the gradients they sum are the ones every step holds anyway."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.config import ConfigError, RunConfig, parse_config
from trainer.plan.communication import IN_LAYER_KINDS, Traffic, expose, groups, step_traffic
from trainer.plan.compute import KernelTime, RankCompute, model_flops_per_token, stages_compute
from trainer.plan.hardware import ClusterSpec, parse_cluster
from trainer.plan.layout import Attention, Layout, Runtime
from trainer.plan.memory import (
    RankMemory,
    expert_elements,
    layout_outside_allocator_terms,
    memory_per_rank,
    rank_state_elements,
    state_elements,
)
from trainer.plan.parameters import RankHolding, rank_holding, stages_of_rank, total_parameters
from trainer.plan.presets import with_preset
from trainer.plan.schedule import Timeline, closed_form_bubble, simulate
from trainer.plan.terms import Term, count

# AdamW reads parameter, gradient and both moments and writes parameter and moments: 28 bytes per
# fp32 parameter, bound by memory bandwidth.
OPTIMIZER_BYTES_PER_PARAMETER = 28
CPU_OPTIMIZER_BANDWIDTH = 50e9
PCIE_BANDWIDTH = 25e9
BUBBLE_WARNING = 0.25


@dataclass
class RankTime:
    pp_rank: int
    compute: RankCompute
    traffic: list[Traffic]
    """The whole step's: every accumulation pass's."""
    passes: int = 1

    def exposed(self, kinds: tuple[str, ...]) -> float:
        return sum(item.exposed_s for item in self.traffic if item.kind in kinds)

    def busy_s(self, microbatches: int) -> float:
        """One pass's work that the pipeline schedule lays out: every microbatch's compute and the in-layer
        communication between its matmuls."""
        return microbatches * self.compute.total_s + self.exposed(IN_LAYER_KINDS) / self.passes


def most_exposed_s(ranks: list[RankTime], kinds: tuple[str, ...]) -> float:
    """The exposed communication of `kinds` on the rank that exposes most: the one the step waits for."""
    return max(rank.exposed(kinds) for rank in ranks)


@dataclass
class Estimate:
    layout: Layout
    cluster: ClusterSpec
    memory: list[RankMemory]
    ranks: list[RankTime]
    time_terms: list[Term]
    step_s: float
    """`step_seconds` of the parts time_terms show."""
    bubble_fraction: float
    timeline: Timeline | None
    warnings: list[dict] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.layout.tokens_per_step / self.step_s

    @property
    def model_flops_per_step(self) -> float:
        return model_flops_per_token(self.layout.model) * self.layout.tokens_per_step

    @property
    def hardware_flops_per_step(self) -> float:
        per_replica = (
            sum(
                rank.compute.forward_flops + rank.compute.backward_flops + rank.compute.recompute_flops
                for rank in self.ranks
            )
            * self.layout.microbatches
            * self.layout.accumulation_steps
        )
        parallel = self.layout.parallel
        return per_replica * parallel.tp * parallel.cp * parallel.data_parallel

    @property
    def mfu(self) -> float:
        peak = self.cluster.gpu_type.peak_bf16_flops
        return self.model_flops_per_step / (self.step_s * self.layout.parallel.world_size * peak)

    @property
    def peak(self) -> RankMemory:
        return max(self.memory, key=lambda rank: rank.reserved_bytes)

    @property
    def outside_allocator(self) -> list[Term]:
        """What each process takes of the GPU besides the allocator: CUDA context, NCCL buffers."""
        return layout_outside_allocator_terms(self.layout)

    @property
    def usable_bytes(self) -> float:
        """The GPU's memory less what lies outside the allocator: what the allocator can hold."""
        return self.cluster.gpu_type.memory_bytes - sum(term.value for term in self.outside_allocator)

    @property
    def headroom_bytes(self) -> float:
        """Usable memory the fullest rank leaves at its peak; negative: it does not fit."""
        return self.usable_bytes - self.peak.reserved_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0

    def comm_by_kind(self) -> dict[str, dict]:
        """Per group kind, over the pipeline rank that spends longest communicating."""
        busiest = max(self.ranks, key=lambda rank: sum(item.time_s for item in rank.traffic))
        kinds: dict[str, dict] = {}
        for item in busiest.traffic:
            entry = kinds.setdefault(item.kind, {"sent_bytes": 0.0, "time_s": 0.0, "exposed_s": 0.0, "ops": []})
            entry["sent_bytes"] += item.sent_bytes
            entry["time_s"] += item.time_s
            entry["exposed_s"] += item.exposed_s
            entry["ops"].append(item.to_json())
        return kinds

    def to_json(self, timeline: bool = True) -> dict:
        layout, parallel = self.layout, self.layout.parallel
        peak = self.peak
        return {
            "config": layout.config.model_dump(mode="json"),
            "cluster": self.cluster.model_dump(mode="json"),
            "layout": {
                "world_size": parallel.world_size,
                "gpus_in_cluster": self.cluster.world_size,
                "zero_stage": parallel.zero,
                "sharding_ranks": parallel.sharding_ranks,
                "global_batch": layout.global_batch,
                "sequences_per_pass": layout.config.sequences_per_pass,
                "accumulation_steps": layout.accumulation_steps,
                "micro_batch": layout.micro_seqs,
                "microbatches": layout.microbatches,
                "tokens_per_step": layout.tokens_per_step,
                "parameters": total_parameters(layout.model),
                "precision": layout.precision,
                "placement": "tp innermost, then cp, dp_shard, dp_replicate, pp",
                "groups_crossing_nodes": sorted(
                    {g.kind for g in groups(layout).values() if g.crosses_nodes(self.cluster.gpus_per_node)}
                ),
            },
            "memory": {
                "capacity_bytes": self.cluster.gpu_type.memory_bytes,
                "outside_allocator": [term.to_json() for term in self.outside_allocator],
                "usable_bytes": self.usable_bytes,
                "peak_bytes": peak.reserved_bytes,
                "headroom_bytes": self.headroom_bytes,
                "peak_allocated_bytes": peak.allocated_bytes,
                "peak_pp_rank": peak.pp_rank,
                "fits": self.fits,
                "ranks": [rank.to_json() for rank in self.memory],
            },
            "flops": {
                "model_flops_per_token": model_flops_per_token(layout.model),
                "model_flops_per_step": self.model_flops_per_step,
                "hardware_flops_per_step": self.hardware_flops_per_step,
            },
            "time": {
                "step_s": self.step_s,
                "terms": [term.to_json() for term in self.time_terms],
            },
            "bubble_fraction": self.bubble_fraction,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "comm": self.comm_by_kind(),
            "timeline": self.timeline.to_json() if timeline and self.timeline else None,
            "warnings": self.warnings,
        }


def parse_plan(document: object, cluster_document: object = None) -> tuple[RunConfig, ClusterSpec]:
    """Validate a run config (a model preset allowed) and a cluster, with every field error at once."""
    errors: dict[str, str] = {}
    config = cluster = None
    try:
        config = parse_config(with_preset(document) if isinstance(document, dict) else document, runnable=False)
    except ConfigError as error:
        errors |= error.errors
    try:
        cluster = parse_cluster(cluster_document)
    except ConfigError as error:
        errors |= error.errors
    if config is not None and cluster is not None:
        errors |= fit_errors(config, cluster)
    if errors:
        raise ConfigError(errors)
    return config, cluster


def fit_errors(config: RunConfig, cluster: ClusterSpec) -> dict[str, str]:
    errors = {}
    world = config.parallel.world_size
    if world > cluster.world_size:
        errors["cluster.nodes"] = (
            f"the layout needs {world} GPUs (pp × dp_replicate × dp_shard × cp × tp); the cluster has "
            f"{cluster.world_size}: at least {-(-world // cluster.gpus_per_node)} nodes"
        )
    if config.compute.precision == "fp8" and cluster.gpu_type.peak_fp8_flops is None:
        errors["compute.precision"] = f"{cluster.gpu} has no fp8 tensor cores; use bf16"
    return errors


def estimate(
    document: object,
    cluster_document: object = None,
    *,
    timeline: bool = True,
    runtime: Runtime = "loom",
    attention: Attention = "flash",
) -> Estimate:
    config, cluster = parse_plan(document, cluster_document)
    return estimate_layout(Layout(config, runtime, attention), cluster, timeline=timeline)


def runtime_errors(layout: Layout) -> dict[str, str]:
    """What the layout's model has that its runtime's model does not, keyed by field: Megatron-LM's GPT and
    torchtitan's llama3 run attention and the MLP one after the other, and their formulas price those blocks."""
    if layout.runtime != "loom" and layout.model.parallel_blocks:
        return {"model.parallel_blocks": f"the {layout.runtime} runtime has no parallel blocks to price; use false"}
    return {}


def estimate_layout(layout: Layout, cluster: ClusterSpec, *, timeline: bool = True) -> Estimate:
    errors = runtime_errors(layout)
    if errors:
        raise ConfigError(errors)
    parallel = layout.parallel
    memory = memory_per_rank(layout)
    ranks = [rank_time(layout, cluster, pp_rank) for pp_rank in range(parallel.pp)]
    busy = [rank.busy_s(layout.microbatches) for rank in ranks]
    drawn = simulate_step(layout, cluster, ranks, busy) if timeline and parallel.pp > 1 else None
    if drawn is not None:
        pass_s, bubble = drawn.step_s, drawn.bubble_fraction
    else:
        bubble = (
            closed_form_bubble(parallel.pp_schedule, parallel.pp, layout.microbatches, layout.stages_per_rank)
            if parallel.pp > 1
            else 0.0
        )
        pass_s = pipeline_seconds(max(busy), bubble)
    slowest = max(range(parallel.pp), key=lambda r: busy[r])
    data_parallel_s, pipeline_p2p_s = most_exposed_s(ranks, ("dp",)), most_exposed_s(ranks, ("pp",))
    optimizer = optimizer_term(layout, cluster)
    terms = time_terms(layout, ranks[slowest], busy[slowest], pass_s, bubble, data_parallel_s, pipeline_p2p_s)
    pipeline_s = layout.accumulation_steps * pass_s
    step_s = step_seconds(pipeline_s, data_parallel_s, pipeline_p2p_s, optimizer.value)
    result = Estimate(layout, cluster, memory, ranks, terms + [optimizer], step_s, bubble, drawn)
    result.warnings = warnings(result)
    return result


def pipeline_seconds(busiest_s: float, bubble: float) -> float:
    """The pipeline's part of a step by the closed-form bubble: the busiest rank's work, stretched."""
    return busiest_s * (1 + bubble)


def step_seconds(pipeline_s: float, data_parallel_s: float, pipeline_p2p_s: float, optimizer_s: float) -> float:
    """A step: the pipeline's part, then the data-parallel and pipeline communication that compute does
    not hide (each on the rank that exposes most), then the optimizer step."""
    return pipeline_s + data_parallel_s + pipeline_p2p_s + optimizer_s


def rank_time(layout: Layout, cluster: ClusterSpec, pp_rank: int) -> RankTime:
    held = rank_holding(layout.model, layout.parallel, pp_rank)
    compute = stages_compute(layout, cluster, held.stages)
    return rank_time_from(layout, cluster, pp_rank, held, compute, state_elements(layout, held.tensors).unsharded)


def rank_time_from(
    layout: Layout, cluster: ClusterSpec, pp_rank: int, held: RankHolding, compute: RankCompute, unsharded: int
) -> RankTime:
    """A pipeline rank's traffic and what of it compute hides, from what the rank holds (`unsharded`:
    its parameters before ZeRO/FSDP sharding) and computes."""
    traffic = step_traffic(
        layout,
        cluster,
        unsharded,
        held.kinds,
        held.holds_embedding,
        held.holds_output,
        expert_elements(layout, held.tensors),
    )
    weight_gradients_s = layout.accumulation_steps * layout.microbatches * compute.weight_gradient_s
    expose(traffic, compute.forward_s, compute.backward_s, held.layers, layout.parallel.pp, weight_gradients_s)
    return RankTime(pp_rank, compute, traffic, layout.accumulation_steps)


def simulate_step(layout: Layout, cluster: ClusterSpec, ranks: list[RankTime], busy: list[float]) -> Timeline:
    """One pass's schedule drawn with each stage's own cost: its FLOPs, stretched by its rank's exposed
    tensor/context/expert-parallel communication."""
    parallel = layout.parallel
    forward, backward, weight = [], [], []
    for stage in range(layout.total_stages):
        rank = next(r for r in range(parallel.pp) if stage in stages_of_rank(parallel, r))
        stretch = busy[rank] / (layout.microbatches * ranks[rank].compute.total_s)
        cost = stages_compute(layout, cluster, [stage])
        forward.append(cost.forward_s * stretch)
        backward.append((cost.backward_s - cost.weight_gradient_s) * stretch)
        weight.append(cost.weight_gradient_s * stretch)
    pp_messages = [item for item in ranks[0].traffic if item.kind == "pp" and item.op == "send"]
    p2p = pp_messages[0].time_s / pp_messages[0].calls if pp_messages else 0.0
    return simulate(
        parallel.pp_schedule, parallel.pp, layout.microbatches, layout.stages_per_rank, forward, backward, weight, p2p
    )


def time_terms(
    layout: Layout,
    slowest: RankTime,
    slowest_busy_s: float,
    pass_s: float,
    bubble: float,
    data_parallel_s: float,
    pipeline_p2p_s: float,
) -> list[Term]:
    """The step's parts before the optimizer's: the slowest rank's compute, its in-layer communication
    and the bubble (together the pipeline's part: `slowest_busy_s` and `pass_s` are one pass's, repeated
    by every accumulation pass), then the exposed data-parallel and pipeline traffic of the whole step."""
    m, passes = layout.microbatches, layout.accumulation_steps
    pass_compute_s = m * slowest.compute.total_s
    per_pass = f"{passes} accumulation passes × " if passes > 1 else ""
    terms = [
        Term(
            "compute",
            passes * pass_compute_s,
            f"{per_pass}{m} microbatch(es) × (forward + backward"
            f"{' + recompute' if slowest.compute.recompute_flops else ''}) kernels of pipeline rank "
            f"{slowest.pp_rank}: {kernel_split(slowest.compute.kernels, layout)}",
        ),
        Term(
            "exposed tp/cp/ep communication",
            passes * (slowest_busy_s - pass_compute_s),
            "collectives between dependent matmuls, not overlapped",
        ),
    ]
    if layout.parallel.pp > 1:
        terms.append(
            Term(
                "pipeline bubble",
                passes * (pass_s - slowest_busy_s),
                f"{per_pass}{layout.parallel.pp_schedule}: bubble fraction {bubble:.3f} of compute "
                f"(p={layout.parallel.pp}, m={m}, v={layout.stages_per_rank})",
            )
        )
    once = f"; gradients reduced once per step of {passes} passes" if passes > 1 else ""
    terms.append(
        Term(
            "exposed data-parallel communication",
            data_parallel_s,
            f"gradient reduction and parameter gathers beyond what backward/forward compute hides{once}",
        )
    )
    if layout.parallel.pp > 1:
        fill = f"{per_pass}fill and drain: 2(p − 1) messages"
        terms.append(Term("exposed pipeline send/recv", pipeline_p2p_s, fill))
    return terms


ATTENTION_KERNELS = {"flash": "flash attention", "flash2": "FlashAttention-2", "unfused": "unfused attention"}


def kernel_split(kernels: KernelTime, layout: Layout) -> str:
    """A microbatch's kernel time by kind, as the terms table shows it."""
    passes = "fused" if layout.fused_passes else "op by op"
    return (
        f"matrix products {kernels.gemm_s * 1e3:.3g} ms (roofline with wave quantization), "
        f"{ATTENTION_KERNELS[layout.attention]} {kernels.attention_s * 1e3:.3g} ms, memory-bound passes ({passes}) "
        f"{kernels.memory_s * 1e3:.3g} ms per microbatch"
    )


def optimizer_seconds(elements: int, layout: Layout, cluster: ClusterSpec) -> float:
    """AdamW's step over `elements` parameters: bound by HBM bandwidth, or on the CPU when offloaded
    (with the gradients copied over PCIe)."""
    if layout.config.optimizer.offload:
        return elements * (OPTIMIZER_BYTES_PER_PARAMETER / CPU_OPTIMIZER_BANDWIDTH + 4 / PCIE_BANDWIDTH)
    return elements * OPTIMIZER_BYTES_PER_PARAMETER / cluster.gpu_type.memory_bandwidth


def optimizer_term(layout: Layout, cluster: ClusterSpec) -> Term:
    """The optimizer step of the pipeline rank that updates most parameters."""
    elements = max(rank_state_elements(layout, r).optimizer for r in range(layout.parallel.pp))
    seconds = optimizer_seconds(elements, layout, cluster)
    if layout.config.optimizer.offload:
        return Term(
            "optimizer step",
            seconds,
            f"on the CPU: {count(elements)} parameters × ({OPTIMIZER_BYTES_PER_PARAMETER} B at "
            f"{CPU_OPTIMIZER_BANDWIDTH / 1e9:g} GB/s + 4 B over PCIe)",
        )
    bandwidth = cluster.gpu_type.memory_bandwidth
    return Term(
        "optimizer step",
        seconds,
        f"{OPTIMIZER_BYTES_PER_PARAMETER} B × {count(elements)} parameters / {bandwidth / 1e12:g} TB/s HBM",
    )


def warnings(result: Estimate) -> list[dict]:
    layout, cluster = result.layout, result.cluster
    parallel, gpn = layout.parallel, cluster.gpus_per_node
    found = []
    crossing = groups(layout)
    if crossing["tp"].crosses_nodes(gpn):
        found.append(
            (
                "parallel.tp",
                f"tp={parallel.tp} spans more than one node ({gpn} GPUs): every layer's "
                "collectives cross the network; keep tp within a node",
            )
        )
    if crossing["cp"].crosses_nodes(gpn):
        found.append(
            (
                "parallel.cp",
                f"tp × cp = {parallel.tp * parallel.cp} spans more than one node: the "
                "key/value exchange crosses the network",
            )
        )
    if not result.fits:
        peak = result.peak
        found.append(
            (
                "memory",
                f"does not fit: pipeline rank {peak.pp_rank} needs {peak.reserved_bytes / 2**30:.1f} GiB of "
                f"the {result.usable_bytes / 2**30:.1f} GiB usable ({cluster.gpu_type.memory_bytes / 2**30:.1f} "
                "GiB less the CUDA context and NCCL's buffers); "
                f"largest part: {max(peak.terms, key=lambda t: t.value).name}",
            )
        )
    if result.bubble_fraction > BUBBLE_WARNING:
        found.append(
            (
                "parallel.microbatches",
                f"pipeline bubble is {result.bubble_fraction:.0%} of compute; "
                "more microbatches or an interleaved schedule shrink it",
            )
        )
    if parallel.world_size < cluster.world_size:
        found.append(("cluster.nodes", f"uses {parallel.world_size} of the cluster's {cluster.world_size} GPUs"))
    return [{"field": name, "message": message} for name, message in found]
