"""Communication per step, per group kind: what each rank sends, how long it takes, how much of it
compute hides.

Ranks are placed tp innermost, then cp, dp_shard, dp_replicate, pp (trainer/parallel/mesh.py), so
a group whose ranks span more than one node's GPUs crosses the network. Time per collective is an
alpha-beta model of the ring algorithms: all-reduce 2(n−1)(α + B/(n·β)), all-gather and
reduce-scatter (n−1)(α + B/(n·β)), all-to-all (n−1)(α + B/(n·β)), send/recv α + B/β, with B the
whole buffer and β the link's bandwidth times the efficiency rings reach.

What is exposed: tensor-, context- and expert-parallel collectives sit between dependent matmuls
(fully exposed in loom's trainer). Megatron-LM overlaps the backward pass's tensor-parallel collectives
with the weight-gradient products (Korthikanti et al. 2022, §6.2): those hide under that compute.
FSDP's all-gathers are prefetched under the previous block's compute and its
reduce-scatters run under the next block's backward; DDP all-reduces buckets under backward: only
what exceeds that compute, plus the first gather and last reduction, is exposed. Pipeline sends
overlap the steady state; the fill and drain, 2(p − 1) messages, are exposed.

Gradient accumulation repeats a step's forward and backward passes: everything inside a pass (tp, cp,
ep, pipeline sends, FSDP's parameter gathers) happens in every pass, while loom's trainer reduces the
gradients once, in the last pass (DDP's and FSDP's sync is off in the others); ZeRO-2, holding only its
gradient shard, must reduce in every pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.plan.hardware import LINK_EFFICIENCY, ClusterSpec
from trainer.plan.layout import PLACEMENT, Layout
from trainer.plan.parameters import BlockKind

# Traffic between dependent matmuls inside a layer: compute never hides it.
IN_LAYER_KINDS = ("tp", "cp", "ep")


@dataclass(frozen=True)
class Group:
    kind: str
    size: int
    stride: int
    """Distance between consecutive members' global ranks."""

    def crosses_nodes(self, gpus_per_node: int) -> bool:
        return self.size > 1 and self.stride * self.size > gpus_per_node


def groups(layout: Layout) -> dict[str, Group]:
    """The groups each kind of traffic runs in; FSDP shards over dp_shard × cp together."""
    parallel = layout.parallel
    degrees = {dim: getattr(parallel, dim) for dim in PLACEMENT}
    strides, stride = {}, 1
    for dim in PLACEMENT:
        strides[dim] = stride
        stride *= degrees[dim]
    return {
        "tp": Group("tp", degrees["tp"], strides["tp"]),
        "cp": Group("cp", degrees["cp"], strides["cp"]),
        "dp_shard": Group("dp", parallel.sharding_ranks, strides["cp"]),
        "dp_replicate": Group("dp", degrees["dp_replicate"], strides["dp_replicate"]),
        "dp": Group("dp", parallel.data_parallel, strides["dp_shard"]),
        "pp": Group("pp", degrees["pp"], strides["pp"]),
        "ep": Group("ep", parallel.ep, strides["cp"]),
        # The ranks that hold the same experts beyond expert parallelism: every ep-th of dp_shard × cp (none where
        # ep also spans replicas, which the planner prices and the trainer does not run).
        "expert_shard": Group("dp", max(1, parallel.sharding_ranks // parallel.ep), strides["cp"] * parallel.ep),
    }


@dataclass
class Traffic:
    """One kind of collective in one group, summed over a step."""

    kind: str
    op: str
    dim: str
    """The group it runs in, a key of `groups()`."""
    group_size: int
    buffer_bytes: float
    """One call's whole buffer (see trainer.traffic.CommOp.nbytes)."""
    calls: float
    inter_node: bool
    passes: int = 1
    """The accumulation passes it is spread over: the compute of that many passes can hide it."""
    overlaps_weight_gradients: bool = False
    """The runtime runs it beside the weight-gradient products (Megatron's backward tp collectives)."""
    time_s: float = 0.0
    exposed_s: float = 0.0
    note: str = ""
    formula: str = field(default="")

    @property
    def sent_bytes(self) -> float:
        """Bytes one rank sends over the step."""
        n = self.group_size
        per_call = {
            "all_reduce": 2 * (n - 1) / n,
            "all_gather": (n - 1) / n,
            "reduce_scatter": (n - 1) / n,
            "all_to_all": (n - 1) / n,
            "send": 1.0,
        }[self.op] * self.buffer_bytes
        return per_call * self.calls

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "op": self.op,
            "group_size": self.group_size,
            "buffer_bytes": self.buffer_bytes,
            "calls": self.calls,
            "sent_bytes": self.sent_bytes,
            "link": "inter-node" if self.inter_node else "intra-node",
            "time_s": self.time_s,
            "exposed_s": self.exposed_s,
            "note": self.note,
        }


def collective_time(op: str, n: int, buffer_bytes: float, cluster: ClusterSpec, inter_node: bool) -> float:
    if n < 2 and op != "send":
        return 0.0
    bandwidth = (cluster.inter_bandwidth if inter_node else cluster.intra_bandwidth) * LINK_EFFICIENCY
    latency = cluster.inter_node_latency_s if inter_node else cluster.intra_node_latency_s
    if op == "send":
        return latency + buffer_bytes / bandwidth
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    return steps * (latency + buffer_bytes / (n * bandwidth))


def step_traffic(
    layout: Layout,
    cluster: ClusterSpec,
    state_elements: int,
    kinds: list[BlockKind],
    holds_embedding: bool,
    holds_output: bool,
    expert_elements: int = 0,
) -> list[Traffic]:
    """Every kind of traffic one rank takes part in during a step. state_elements counts the
    parameters the rank holds before sharding (after tp, pp, ep), expert_elements those of them that are
    experts split by expert parallelism; kinds its blocks."""
    parallel, model = layout.parallel, layout.model
    rank_layers = sum(kind.layers for kind in kinds)
    moe_layers = sum(kind.layers for kind in kinds if kind.model.experts > 1)
    gpn = cluster.gpus_per_node
    group = groups(layout)
    # Every pass of an accumulating step repeats its microbatches' in-pass traffic.
    passes = layout.accumulation_steps
    m, e, c = passes * layout.microbatches, layout.activation_bytes, layout.compute_bytes
    recompute = layout.config.compute.recompute
    # Recompute repeats the forward's collectives: full every one, loom's selective the attention sub-block's
    # (half), Megatron's selective none (the attention core alone communicates nothing).
    selective = 0.0 if layout.runtime == "megatron" else 0.5
    repeats = {"none": 0, "selective": selective, "full": 1}[recompute]
    sbh = layout.local_seq * layout.micro_seqs * model.dim * e
    traffic: list[Traffic] = []

    def add(kind: str, op: str, dim: str, buffer: float, calls: float, note: str, overlapped: bool = False) -> None:
        members = group[dim]
        if members.size > 1 and calls > 0 and buffer > 0:
            crosses = members.crosses_nodes(gpn)
            traffic.append(
                Traffic(
                    kind,
                    op,
                    dim,
                    members.size,
                    buffer,
                    calls,
                    crosses,
                    passes,
                    overlaps_weight_gradients=overlapped,
                    note=note,
                )
            )

    if parallel.tp > 1:
        # Per block: two collectives forward (after wo and after w2) and two backward (before the
        # q/k/v and w1/w3 input gradients); sequence parallel turns each into a gather and a scatter
        # (forward: gather in, scatter out; backward the reverse). Recompute repeats the forward ones;
        # the embedding and the output add one each way. Megatron hides the backward ones (`expose`).
        ends = (1 if holds_embedding else 0) + (1 if holds_output else 0)
        per_block = 4 + 2 * repeats
        per_moe_block = per_block
        if moe_reduces_its_own(layout):
            # Only attention all-reduces, forward, backward and once more if recomputed.
            per_moe_block = 2 + (2 * repeats - (1 if recompute == "full" else 0))
        everything = m * ((rank_layers - moe_layers) * per_block + moe_layers * per_moe_block + ends)
        backward = m * rank_layers * 2 if layout.runtime == "megatron" else 0
        if parallel.sequence_parallel:
            for op, note in (
                ("all_gather", "sequence parallel: into q/k/v and the MLP"),
                ("reduce_scatter", "sequence parallel: out of wo and w2"),
            ):
                add("tp", op, "tp", sbh, everything - backward, note)
                add("tp", op, "tp", sbh, backward, f"{note}; backward, beside the weight gradients", overlapped=True)
        else:
            add(
                "tp",
                "all_reduce",
                "tp",
                sbh,
                everything - backward,
                "after wo and w2 forward, before q/k/v and w1/w3 backward",
            )
            add(
                "tp",
                "all_reduce",
                "tp",
                sbh,
                backward,
                "before q/k/v and w1/w3 backward, beside the weight gradients",
                overlapped=True,
            )
    if loom_experts_under_tp(layout):
        for op, buffer, calls, note in moe_tensor_parallel_collectives(layout, sbh, recompute == "full"):
            add("tp", op, "tp", buffer, m * moe_layers * calls, note)
    if parallel.cp > 1:
        head_dim = model.dim // model.heads
        kv = 2 * model.seq_len * layout.micro_seqs * model.kv_heads * head_dim / parallel.tp * e
        add("cp", "all_gather", "cp", kv, m * rank_layers * (1 + repeats * 2), "keys and values of every cp rank")
        add("cp", "reduce_scatter", "cp", kv, m * rank_layers, "their gradients back to their owners")
    if model.experts > 1 and parallel.ep > 1:
        tokens = layout.local_seq * layout.micro_seqs * model.dim * e * model.top_k
        add("ep", "all_to_all", "ep", tokens, m * moe_layers * (4 + 2 * repeats), "dispatch and combine, both ways")
    traffic += data_parallel_traffic(layout, group, gpn, state_elements, c, expert_elements)
    if parallel.pp > 1:
        split = parallel.tp if layout.sequence_parallel else 1
        message = sbh / split
        add("pp", "send", "pp", message, 2 * m * layout.stages_per_rank, "activations forward, gradients backward")
    traffic += tied_embedding_traffic(layout, group["pp"], gpn, holds_embedding, holds_output)
    time_traffic(traffic, cluster)
    return traffic


def tied_embedding_traffic(
    layout: Layout, pipeline: Group, gpn: int, holds_embedding: bool, holds_output: bool
) -> list[Traffic]:
    """The all-reduce that gives a tied embedding's two copies, on the first and the last pipeline rank, the sum of
    their gradients once a step, after the data-parallel reductions (trainer/parallel/tied.py): the rank's part of
    the vocab × dim gradient, split over the vocabulary by tp and, where gradients are sharded, over the sharding
    ranks. None where one rank holds both (a single stage, V schedules)."""
    model, parallel = layout.model, layout.parallel
    if not model.tie_embeddings or holds_embedding == holds_output:
        return []
    gradient_bytes = 4 if layout.keeps_fp32_master_parameters else layout.compute_bytes
    sharding = parallel.sharding_ranks if layout.zero_at_rest >= 2 else 1
    buffer = gradient_bytes * model.vocab * model.dim / parallel.tp / sharding
    note = "tied embeddings: the first and the last stage's gradients of the shared matrix, summed"
    return [Traffic("pp", "all_reduce", "pp", 2, buffer, 1, pipeline.crosses_nodes(gpn), note=note)]


def moe_reduces_its_own(layout: Layout) -> bool:
    """Whether loom's mixture-of-experts block does its own tensor-parallel collectives in place of the dense MLP's
    all-reduces: without sequence parallelism (with it, its routed experts move what a dense MLP moves)."""
    return loom_experts_under_tp(layout) and not layout.parallel.sequence_parallel


def loom_experts_under_tp(layout: Layout) -> bool:
    """Whether loom's trainer runs a mixture of experts under tensor parallelism (trainer/parallel/moe_tensor.py)."""
    return layout.runtime == "loom" and layout.model.experts > 1 and layout.parallel.tp > 1


def moe_tensor_parallel_collectives(
    layout: Layout, sbh: float, full_recompute: bool
) -> list[tuple[str, float, float, str]]:
    """(op, buffer bytes, calls per block, note) that loom's mixture-of-experts block adds under tensor parallelism
    (trainer/parallel/moe_tensor.py) to what a dense block's MLP moves, which its routed experts move too under
    sequence parallelism. Without it the block first takes its part of the sequence and gives the whole back, so
    its experts' reductions are gathers and scatters where a dense MLP all-reduces. Full recompute repeats the
    forward ones."""
    model = layout.model
    routed = layout.local_seq * layout.micro_seqs * model.top_k
    again = 1 if full_recompute else 0
    collectives = [
        ("all_gather", routed * 8, 1 + again, "MoE: every rank's routing choices"),
        ("all_gather", routed * 4, 1 + again, "MoE: every rank's gates (fp32)"),
        ("reduce_scatter", routed * 4, 1, "MoE: the gates' gradients back to the ranks that routed them"),
    ]
    if model.moe.shared_expert:
        collectives += [
            ("all_gather", sbh, 2 + again, "MoE shared expert: into w1/w3, and its gradient backward"),
            ("reduce_scatter", sbh, 2 + again, "MoE shared expert: out of w2, and its input's gradient backward"),
        ]
    if moe_reduces_its_own(layout):
        collectives += [
            ("all_gather", sbh, 4 + 2 * again, "MoE: the sequence into the experts, their output whole, both ways"),
            ("reduce_scatter", sbh, 2 + again, "MoE: the experts' partial outputs, and their inputs' gradients"),
        ]
    return collectives


def time_traffic(traffic: list[Traffic], cluster: ClusterSpec) -> None:
    """Fill in time_s: every call of each collective on its link."""
    for item in traffic:
        item.time_s = (
            collective_time(item.op, item.group_size, item.buffer_bytes, cluster, item.inter_node) * item.calls
        )


def data_parallel_traffic(
    layout: Layout, group: dict[str, Group], gpn: int, elements: int, c: int, expert_elements: int = 0
) -> list[Traffic]:
    """The data-parallel collectives of `elements` parameters, of which `expert_elements` are experts split by
    expert parallelism: those are sharded over the ranks that hold the same experts (expert_shard), the rest
    over dp_shard × cp."""
    parallel, m = layout.parallel, layout.microbatches
    zero, passes = parallel.zero, layout.accumulation_steps
    # Said of what runs once per step when the step accumulates: its reduction waits for the last pass.
    once = f", once per step of {passes} passes" if passes > 1 else ""
    traffic: list[Traffic] = []

    def add(op: str, dim: str, buffer: float, calls: float, note: str, every_pass: bool = False) -> None:
        members = group[dim]
        if members.size < 2 or buffer <= 0:
            return
        spread, times = (passes, calls * passes) if every_pass else (1, calls)
        crosses = members.crosses_nodes(gpn)
        traffic.append(Traffic("dp", op, dim, members.size, buffer, times, crosses, spread, note=note))

    if zero == 0:
        if group["dp"].size > 1:
            # Replicas under TP or PP all-reduce through FSDP2's HSDP, one shard a replica: the same bytes.
            how = "DDP" if parallel.data_parallel_path == "ddp" else "HSDP of whole replicas"
            add("all_reduce", "dp", 4 * elements, 1, f"{how}: fp32 gradients{once}")
        return traffic
    shards = [("dp_shard", elements - expert_elements, ""), ("expert_shard", expert_elements, " of the experts")]
    replicas_every_pass = False
    if layout.zero_at_rest == 3:
        # loom's FSDP2, at every stage. Resharding after forward (ZeRO-3 only) gathers again for every microbatch's
        # forward and once for backward; ZeRO-1 keeps the parameters gathered from pass to pass. ZeRO-2 reduces
        # every pass's gradients, the others wait for the last pass.
        gathers = m + 1 if parallel.reshards_after_forward else 1
        before = "before forward" + (" and backward" if gathers > 1 else "")
        every = " in every pass" if passes > 1 else ""
        if gathered_between_passes(layout):
            # A step gathers once less in every pass after the first, counted here as a fraction of each pass.
            gathers -= (passes - 1) / passes
            every = f" in every pass, the first's kept gathered into the next {passes - 1}"
        who = "FSDP" if zero == 3 else f"ZeRO-{zero} on FSDP"
        replicas_every_pass = zero == 2
        for dim, count, whose in shards:
            gathered = f"{who}: parameters{whose} {before}{once if zero == 1 else every}"
            add("all_gather", dim, c * count, gathers, gathered, every_pass=zero != 1)
            reduced = f"{who}: fp32 gradients{whose}{every if replicas_every_pass else once}"
            add("reduce_scatter", dim, 4 * count, 1, reduced, every_pass=replicas_every_pass)
        grad_bytes = 4
    else:
        # ZeRO-2 holds only its shard of the gradients, so each pass's go to their owners; ZeRO-1 sums whole ones.
        every = " in every pass" if zero == 2 else once
        for dim, count, whose in shards:
            reduce_note = f"ZeRO-{zero}: gradients{whose} to their optimizer shard{every}"
            add("reduce_scatter", dim, c * count, 1, reduce_note, every_pass=zero == 2)
            add("all_gather", dim, c * count, 1, f"ZeRO-{zero}: updated parameters{whose}")
        grad_bytes = c
    if group["dp_replicate"].size > 1:
        shard_bytes = sum(grad_bytes * count / group[dim].size for dim, count, _ in shards)
        across = f"HSDP: each shard's gradients across replicas{every if replicas_every_pass else once}"
        add("all_reduce", "dp_replicate", shard_bytes, 1, across, every_pass=replicas_every_pass)
    return traffic


def gathered_between_passes(layout: Layout) -> bool:
    """Whether loom's ZeRO-3 keeps a pipeline stage's parameters gathered from one accumulation pass to the next: a
    pass that does not reduce leaves out the schedule's end-of-run action (trainer/parallel/pipeline.py), which also
    reshards, so the next pass starts with them whole."""
    parallel = layout.parallel
    return layout.runtime == "loom" and parallel.zero == 3 and parallel.pp > 1 and layout.accumulation_steps > 1


def expose(
    traffic: list[Traffic],
    forward_s: float,
    backward_s: float,
    rank_layers: int,
    pipeline_ranks: int,
    weight_gradients_s: float = 0.0,
) -> None:
    """Fill in exposed_s: what compute cannot hide (see the module docstring). forward_s and backward_s
    are one pass's; traffic spread over several passes is hidden by (and exposes its ends in) each.
    weight_gradients_s: the step's weight-gradient compute, which hides the collectives that overlap it."""
    layers = max(rank_layers, 1)
    beside_weight_gradients = weight_gradients_s
    for item in traffic:
        passes = item.passes
        if item.overlaps_weight_gradients:
            item.exposed_s = max(0.0, item.time_s - beside_weight_gradients)
            beside_weight_gradients = max(0.0, beside_weight_gradients - item.time_s)
        elif item.kind in IN_LAYER_KINDS:
            item.exposed_s = item.time_s
        elif item.kind == "pp":
            per_message = item.time_s / item.calls
            item.exposed_s = min(item.time_s, passes * 2 * (pipeline_ranks - 1) * per_message)
        elif item.op == "all_gather":
            hidden = passes * (forward_s + backward_s)
            item.exposed_s = max(0.0, item.time_s - hidden) + passes * item.time_s / item.calls / layers
        else:
            item.exposed_s = max(0.0, item.time_s - passes * backward_s) + passes * item.time_s / item.calls / layers
