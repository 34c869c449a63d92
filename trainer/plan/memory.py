"""Memory per GPU for every pipeline rank: model states, activations, buffers, and the peak.

Model states by ZeRO stage (Rajbhandari et al. 2020) over the N = dp_shard × cp sharding ranks,
Φ the parameters a rank holds after tensor and pipeline splits:

- loom's trainer (no sharding, or FSDP2 = ZeRO-3) keeps fp32 parameters, fp32 gradients and
  AdamW's two fp32 moments: 4Φ + 4Φ + 8Φ = 16Φ, or 16Φ/N sharded; in bf16 it computes on bf16
  copies made on the fly (the "working copies" term).
- ZeRO-1/2 in bf16 (Megatron-LM's distributed optimizer, DeepSpeed) keep bf16 parameters and
  gradients and 12 bytes of optimizer state (fp32 master, two moments): 2Φ + 2Φ + 12Φ/N (ZeRO-1),
  2Φ + 14Φ/N (ZeRO-2); ZeRO-3 is 16Φ/N either way.

AdamW also keeps one 4-byte step count per parameter tensor. Activations come from
trainer.plan.activations times the microbatches a pipeline rank holds at its peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.plan.activations import (
    SavedTensor,
    Shape,
    kept,
    layer_bytes,
    loom_layer,
    megatron_layer,
    torchtitan_per_op_layer,
)
from trainer.plan.communication import gathered_between_passes
from trainer.plan.layout import PLACEMENT, Layout
from trainer.plan.parameters import (
    BlockKind,
    ParameterTensor,
    held_block_kinds,
    held_layers,
    local_elements,
    rank_holding,
    stages_of_rank,
)
from trainer.plan.terms import Term, count, total

GIB = 2**30
MIB = 2**20
# What PyTorch's caching allocator holds beyond what tensors use: blocks split and rounded up that
# cannot serve the next request (fragmentation). torch.cuda.max_memory_reserved runs a few to ~10 %
# above max_memory_allocated in steady training without expandable segments.
ALLOCATOR_MARGIN = 0.07
# Outside the allocator, per process: the CUDA context (driver state, module images of PyTorch's
# kernels loaded lazily, cuBLAS/cuBLASLt workspaces), 0.5-1 GiB as nvidia-smi shows for a torch
# process that has run a training step on an A100/H100.
CONTEXT_BYTES = 0.75 * GIB
# NCCL's buffers, per communicator a rank belongs to: per channel and connected peer, one buffer per
# protocol, Simple's NCCL_BUFFSIZE (4 MiB by default), LL128's 120 elements x 640 threads x 8 steps
# x 8 B and LL's 8 lines x 512 threads x 8 steps x 16 B (NCCL's src/include/device.h). With 16
# channels (what NCCL opens over NVLink) and 2 connected peers each (ring neighbour, tree parent or
# child; NCCL >= 2.22 connects the algorithms it uses only): 294 MiB. NVLS (NVLink SHARP) buffers
# come on top where NCCL enables them; NCCL_BUFFSIZE and NCCL_MAX_NCHANNELS move the figure.
NCCL_CONNECTION_BYTES = 4 * MIB + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16
NCCL_CHANNELS = 16
NCCL_PEERS_PER_CHANNEL = 2
NCCL_COMMUNICATOR_BYTES = NCCL_CHANNELS * NCCL_PEERS_PER_CHANNEL * NCCL_CONNECTION_BYTES


def in_flight_microbatches(layout: Layout, pp_rank: int) -> float:
    """Microbatches whose activations a pipeline rank holds at its peak, in units of one
    microbatch through all the rank's layers (PyTorch's op orders; trainer.plan.schedule's
    simulation counts the same in stage-microbatches).

    GPipe holds all m; LoopedBFS all m of every local stage. 1F1B holds p − r on rank r.
    Interleaved 1F1B warms up with (v − 1)p + 2(p − r − 1) + 1 chunks of 1/v of the rank's layers
    (p(1 + (p − 1)/(pv)) on the first rank, Narayanan et al. 2021); PyTorch's interleaved
    zero-bubble order warms up with (v − 1)p + (p − r − 1) + 1. ZB-V holds 2p half-ranks (= p, as
    1F1B's first rank), DualPipeV 2p + 1."""
    p, v, m = layout.pipeline_ranks, layout.stages_per_rank, layout.microbatches
    schedule = layout.parallel.pp_schedule
    if p == 1:
        return 1
    if schedule in ("GPipe", "LoopedBFS"):
        return m
    if schedule == "Interleaved1F1B":
        chunks = (v - 1) * p + 2 * (p - pp_rank - 1) + 1
    elif schedule == "InterleavedZeroBubble":
        chunks = (v - 1) * p + (p - pp_rank - 1) + 1
    elif schedule == "ZBVZeroBubble":
        chunks = 2 * p
    elif schedule == "DualPipeV":
        chunks = 2 * p + 1
    else:
        return min(p - pp_rank, m)
    return min(chunks, m * v) / v


@dataclass(frozen=True)
class StateElements:
    """Elements a rank holds of each kind of model state, and its parameter tensors."""

    parameters: int
    gradients: int
    optimizer: int
    tensors: int
    unsharded: int
    """Parameters before ZeRO/FSDP sharding (after tp, ep and pp)."""


def state_elements(layout: Layout, tensors: list[ParameterTensor], shard_index: int = 0) -> StateElements:
    """What a rank holding `tensors` (by name or by kind) keeps of each; shard_index picks its FSDP chunk."""
    parallel, zero = layout.parallel, layout.zero_at_rest
    whole = chunked = 0
    for tensor in tensors:
        whole += tensor.copies * local_elements(tensor, parallel, False, shard_index)
        chunked += tensor.copies * local_elements(tensor, parallel, True, shard_index)

    def sharded_from(stage: int) -> int:
        """Elements of a state that ZeRO shards from this stage on."""
        return chunked if zero >= stage else whole

    gradients = sharded_from(2) + unsharded_embedding_gradient(layout, tensors)
    return StateElements(sharded_from(3), gradients, sharded_from(1), sum(tensor.copies for tensor in tensors), whole)


def expert_elements(layout: Layout, tensors: list[ParameterTensor]) -> int:
    """Of `state_elements(...).unsharded`, the experts' share where expert parallelism splits them (which FSDP
    then shards over the ranks holding the same experts); 0 without it."""
    if layout.parallel.ep == 1:
        return 0
    return state_elements(layout, [tensor for tensor in tensors if tensor.expert]).unsharded


def unsharded_embedding_gradient(layout: Layout, tensors: list[ParameterTensor]) -> int:
    """Elements beyond the shard that a vocab-parallel embedding's gradient takes.

    DTensor's backward of the row-wise (vocab-sharded) embedding yields the gradient over the whole
    vocabulary, pending reduction; FSDP2 reduces it into its shard at once (also when it only
    replicates: HSDP with one shard per replica), but without it or sharded gradients each tp rank
    keeps all vocab × dim of it until the optimizer step. Tied to the output layer, whose column-parallel
    gradient (a shard) the parameter takes first, it adds into that shard."""
    tp = layout.parallel.tp
    if tp == 1 or layout.zero_at_rest >= 2 or reduces_block_by_block(layout) or layout.model.tie_embeddings:
        return 0
    return sum(t.copies * t.elements * (tp - 1) // tp for t in tensors if t.name == "embedding.weight")


def rank_state_elements(layout: Layout, pp_rank: int, shard_index: int = 0) -> StateElements:
    """`state_elements` of what pipeline rank `pp_rank` holds."""
    return state_elements(layout, rank_holding(layout.model, layout.parallel, pp_rank).tensors, shard_index)


def model_state_terms(layout: Layout, elements: StateElements) -> list[Term]:
    zero, n = layout.zero_at_rest, layout.parallel.sharding_ranks
    shard = lambda stage: f"/N (N={n})" if zero >= stage and n > 1 else ""  # noqa: E731
    if layout.keeps_fp32_master_parameters:
        parameter_bytes, gradient_bytes, optimizer_bytes = 4, 4, 8
        optimizer_what = "AdamW moments m, v in fp32"
    else:
        parameter_bytes, gradient_bytes, optimizer_bytes = 2, 2, 12
        optimizer_what = "fp32 master copy + AdamW moments m, v"
    terms = [
        Term(
            "parameters",
            parameter_bytes * elements.parameters,
            f"{parameter_bytes} B × Φ{shard(3)} = {parameter_bytes} × {count(elements.parameters)}",
        ),
        Term(
            "gradients",
            gradient_bytes * elements.gradients,
            f"{gradient_bytes} B × Φ{shard(2)} = {gradient_bytes} × {count(elements.gradients)}",
        ),
    ]
    optimizer = optimizer_bytes * elements.optimizer + 4 * elements.tensors
    formula = (
        f"{optimizer_bytes} B × Φ{shard(1)} ({optimizer_what}) + 4 B × {elements.tensors} step counts"
        f" = {optimizer_bytes} × {count(elements.optimizer)} + {4 * elements.tensors}"
    )
    if layout.config.optimizer.offload:
        terms.append(Term("optimizer states", 0, f"offloaded to CPU memory: {count(optimizer)} B there"))
    else:
        terms.append(Term("optimizer states", optimizer, formula))
    return terms


def reduces_block_by_block(layout: Layout) -> bool:
    """Whether FSDP2 gathers each block's parameters and reduces its gradients: at every ZeRO stage of loom's
    trainer, and where it only replicates (HSDP with one shard per replica); ZeRO-1/2 elsewhere gather and
    reduce flat buffers."""
    return layout.parallel.fully_shards and layout.zero_at_rest in (0, 3)


def buffer_terms(layout: Layout, pp_rank: int, elements: StateElements) -> list[Term]:
    """Working copies of parameters and gradients that communication and mixed precision need."""
    parallel, c = layout.parallel, layout.compute_bytes
    rank_layers = held_layers(layout.model, layout.total_stages, stages_of_rank(parallel, pp_rank))
    block_by_block = reduces_block_by_block(layout)
    terms = []
    if block_by_block:
        per_layer = elements.unsharded / max(rank_layers, 1)
        reduce_bytes = c + (4 if c != 4 else 0)
        if parallel.reshards_after_forward and not gathered_between_passes(layout):
            terms.append(
                Term(
                    "FSDP gathered parameters",
                    2 * c * per_layer,
                    f"2 blocks (current + prefetched) × {c} B × {count(round(per_layer))} parameters",
                )
            )
        else:
            held = {
                1: "gathered once per step, held through every pass",
                2: "gathered once per pass, held through it",
            }.get(parallel.zero, "every block stays gathered from forward to backward")
            if gathered_between_passes(layout):
                held = "a pipeline's inner accumulation passes leave every block gathered into the next"
            terms.append(
                Term("FSDP gathered parameters", c * elements.unsharded, f"{held}: {c} B × {count(elements.unsharded)}")
            )
        if layout.config.accumulation_steps > 1 and parallel.zero != 2:
            # loom's trainer skips the reduce-scatter on inner accumulation passes (set_requires_gradient_sync),
            # so FSDP2 keeps every block's gradients whole, accumulated in fp32, until the last pass; ZeRO-2
            # reduce-scatters every pass's and keeps only its shard.
            terms.append(
                Term(
                    "FSDP accumulated gradients",
                    4 * elements.unsharded,
                    f"gradients held unsharded between {layout.config.accumulation_steps} accumulation passes: "
                    f"4 B × {count(elements.unsharded)}",
                )
            )
        else:
            terms.append(
                Term(
                    "FSDP unsharded gradients",
                    reduce_bytes * per_layer,
                    f"one block's gradients before reduce-scatter: {reduce_bytes} B × {count(round(per_layer))}",
                )
            )
    elif parallel.zero == 0 and parallel.data_parallel > 1:
        terms.append(
            Term(
                "DDP gradient buckets",
                4 * elements.unsharded,
                f"buckets hold a copy of every gradient: 4 B × {count(elements.unsharded)}",
            )
        )
    if parallel.zero in (0, 3) and c == 2 and not block_by_block:
        terms.append(
            Term(
                "bf16 weight copies (autocast)",
                2 * elements.unsharded,
                f"kept from forward to backward: 2 B × {count(elements.unsharded)}",
            )
        )
    return terms


def layer_tensors(layout: Layout, shape: Shape) -> list[SavedTensor]:
    """What one block keeps for backward in this layout, for a rank holding `shape`."""
    parallel = layout.parallel
    if layout.runtime == "torchtitan" and layout.config.compute.recompute == "selective":
        return torchtitan_per_op_layer(shape, layout.model, layout.activation_bytes, layout.sequence_parallel)
    if layout.runtime == "megatron":
        # Megatron-LM's GPT recipes train with dropout 0.1, its Llama recipes without.
        gpt = layout.model.mlp == "gelu"
        return megatron_layer(shape, swiglu=not gpt, flash=layout.attention != "unfused", dropout=gpt)
    return loom_layer(
        shape,
        layout.model,
        layout.activation_bytes,
        layout.matmul_input_bytes,
        layout.model.seq_len,
        layout.fused_kernels,
        layout.residual_bytes,
        layout.autocast,
        parallel.tp,
        layout.sequence_parallel,
    )


def layer_activation_bytes(layout: Layout, recompute: str | None = None) -> float:
    """What one block keeps for one microbatch on a rank of this layout (under `recompute`, by default the
    layout's own mode)."""
    tensors = layer_tensors(layout, Shape.of(layout.model, layout.local_seq, layout.micro_seqs))
    recompute = recompute or layout.config.compute.recompute
    return layer_bytes(tensors, recompute, layout.parallel.tp, layout.sequence_parallel)


def kind_activations(layout: Layout, kind: BlockKind, held: float) -> tuple[float, str]:
    """What `kind`'s blocks keep (`layout` is that of their own model) with `held` microbatches in flight, and how."""
    model, parallel = layout.model, layout.parallel
    shape = Shape.of(model, layout.local_seq, layout.micro_seqs)
    tensors = layer_tensors(layout, shape)
    recompute, tp, sp = layout.config.compute.recompute, parallel.tp, layout.sequence_parallel
    layers = kind.layers
    per_layer = layer_bytes(tensors, recompute, tp, sp)
    mode = {"none": "no recompute", "selective": "selective recompute", "full": "full recompute"}[recompute]
    parts = " + ".join(f"{t.symbol}·{t.bytes_per_element:g}B" for t in kept(tensors, recompute))
    shape_text = f"s={shape.s}, b={shape.b}, h={shape.h}, t={tp}{', SP' if sp else ''}"
    every = layout.config.compute.recompute_every
    if every == 1:
        value = per_layer * layers * held
        formula = (
            f"{count(layers)} layers × {count(held)} microbatches in flight × {count(round(per_layer))} B/layer"
            f" ({mode}, {shape_text}: {parts})"
        )
        return value, formula
    recomputed = kind.recomputed(layout.config.compute)
    whole = layer_activation_bytes(layout, "none")
    value = (per_layer * recomputed + whole * (layers - recomputed)) * held
    formula = (
        f"({count(recomputed)} layers × {count(round(per_layer))} B ({mode}, every {every}th block) + "
        f"{count(layers - recomputed)} × {count(round(whole))} B (no recompute)) × {count(held)} microbatches "
        f"in flight ({shape_text})"
    )
    return value, formula


def activation_terms(layout: Layout, pp_rank: int) -> list[Term]:
    """Kept activations of every layer the rank holds, times the microbatches in flight, plus the
    last stage's logits. With compute.recompute_every N > 1 only every N-th block recomputes; the
    others keep what they keep without recompute. A mixture of experts' dense blocks keep their own."""
    stages = stages_of_rank(layout.parallel, pp_rank)
    held = in_flight_microbatches(layout, pp_rank)
    kinds = held_block_kinds(layout.model, layout.total_stages, stages)
    value, formulas = 0.0, []
    for kind in kinds:
        kind_value, formula = kind_activations(layout.with_blocks(kind.model), kind, held)
        value += kind_value
        formulas.append(formula if len(kinds) == 1 else f"{'MoE' if kind.model.experts > 1 else 'dense'}: {formula}")
    formula = " + ".join(formulas) or "no blocks on this rank"
    terms = [Term("activations", value, formula)]
    if layout.total_stages - 1 in stages:
        terms.append(logits_term(layout, held))
    return terms


def logits_term(layout: Layout, held: float) -> Term:
    model, s, b, e = layout.model, layout.local_seq, layout.micro_seqs, layout.activation_bytes
    if layout.fused_loss:
        rows_vocab = s * b * model.dim
        return Term(
            "logits and cross-entropy",
            (e + 4) * rows_vocab,
            f"chunked: one chunk of logits ≈ the hidden states, (e + 4 B fp32) × s·b·h = {e + 4} × {count(rows_vocab)}",
        )
    # Loss parallel (always, in Megatron) keeps each tp rank's share of the vocabulary; without it the logits
    # are gathered whole on every rank.
    vocab_split = layout.parallel.tp if layout.parallel.loss_parallel or layout.runtime == "megatron" else 1
    logits = s * b * model.vocab / vocab_split
    kept_bytes = 4 * logits * held
    if layout.runtime == "megatron":
        # Its fused vocab-parallel cross-entropy turns the kept softmax into the gradient in place.
        transient, what = (e + 4) * logits, f"logits and their fp32 gradient ({e + 4} B × s·b·V/t)"
    elif vocab_split > 1:
        # PyTorch's loss parallel (torchtitan's, under tp) on vocabulary-sharded DTensor logits: forward holds the
        # logits, their fp32 copy and one fp32 intermediate besides what is kept (e + 8 B), backward three fp32
        # tensors the logits' size (12 B). Measured on CPU: tests/trainer/test_loss_memory.py.
        transient = max(e + 8, 12) * logits
        what = f"in backward PyTorch's loss parallel's three fp32 tensors ({max(e + 8, 12)} B × s·b·V/t)"
    else:
        # PyTorch's cross_entropy on fp32 logits: forward holds the logits, their fp32 copy and the log-probabilities
        # (e + 4 B besides what is kept); backward, the log-probabilities' gradient and the logits' (8 B), once the
        # logits themselves are gone.
        transient = max(e + 4, 8) * logits
        what = f"in backward the fp32 gradients of the log-probabilities and the logits ({max(e + 4, 8)} B × s·b·V/t)"
    return Term(
        "logits and cross-entropy",
        kept_bytes + transient,
        f"fp32 log-probabilities kept per microbatch in flight (4 B × s·b·V/t × {count(held)}) + {what}, "
        f"s·b·V/t = {count(logits)} (t = {vocab_split})",
    )


def pipeline_buffer_term(layout: Layout) -> list[Term]:
    if layout.pipeline_ranks == 1:
        return []
    parallel = layout.parallel
    split = parallel.tp if layout.sequence_parallel else 1
    message = layout.local_seq * layout.micro_seqs * layout.model.dim / split * layout.activation_bytes
    buffers = 2 * layout.stages_per_rank
    return [
        Term(
            "pipeline send/receive buffers",
            buffers * message,
            f"{buffers} (activation in, gradient in per stage) × s·b·h/{split} × {layout.activation_bytes} B",
        )
    ]


def reserved_bytes(allocated: float) -> float:
    """What the caching allocator holds for a peak of `allocated` tensor bytes: its fragmentation on top."""
    return allocated * (1 + ALLOCATOR_MARGIN)


def communicators(tp: int, cp: int, pp: int, dp_replicate: int, dp_shard: int, ep: int) -> int:
    """NCCL communicators each rank joins: one per process group wider than one rank (tp, cp, the FSDP
    group over dp_shard × cp, dp_replicate, ep), and one per pipeline neighbour (PyTorch gives each
    send/recv pair its own)."""
    groups = [tp, cp, dp_shard * cp if dp_shard > 1 else 1, dp_replicate, ep]
    return sum(size > 1 for size in groups) + min(pp - 1, 2)


def outside_allocator_terms(tp: int, cp: int, pp: int, dp_replicate: int, dp_shard: int, ep: int) -> list[Term]:
    """What each process takes of the GPU besides the caching allocator's blocks."""
    joined = communicators(tp, cp, pp, dp_replicate, dp_shard, ep)
    return [
        Term("CUDA context", CONTEXT_BYTES, "driver, kernels and cuBLAS workspaces: 0.5-1 GiB per process"),
        Term(
            "NCCL buffers",
            joined * NCCL_COMMUNICATOR_BYTES,
            f"{joined} communicator(s) × {NCCL_CHANNELS} channels × {NCCL_PEERS_PER_CHANNEL} peers × "
            f"{NCCL_CONNECTION_BYTES / MIB:.2f} MiB (Simple 4 MiB + LL128 + LL buffers)",
        ),
    ]


def layout_outside_allocator_terms(layout: Layout) -> list[Term]:
    parallel = layout.parallel
    return outside_allocator_terms(
        parallel.tp, parallel.cp, parallel.pp, parallel.dp_replicate, parallel.dp_shard, parallel.ep
    )


@dataclass(frozen=True)
class RankMemory:
    pp_rank: int
    stages: list[int]
    terms: list[Term]

    @property
    def allocated_bytes(self) -> float:
        """What torch.cuda.max_memory_allocated would show at the peak."""
        return total(self.terms)

    @property
    def reserved_bytes(self) -> float:
        """What torch.cuda.max_memory_reserved would show at the peak."""
        return reserved_bytes(self.allocated_bytes)

    def to_json(self) -> dict:
        return {
            "pp_rank": self.pp_rank,
            "stages": self.stages,
            "allocated_bytes": self.allocated_bytes,
            "reserved_bytes": self.reserved_bytes,
            "terms": [term.to_json() for term in self.terms],
        }


def rank_memory(layout: Layout, pp_rank: int) -> RankMemory:
    elements = rank_state_elements(layout, pp_rank)
    terms = model_state_terms(layout, elements)
    terms += buffer_terms(layout, pp_rank, elements)
    terms += activation_terms(layout, pp_rank)
    terms += pipeline_buffer_term(layout)
    if gradients_fill_as_activations_free(layout):
        terms = gradients_at_the_peak(layout, terms)
    return RankMemory(pp_rank, stages_of_rank(layout.parallel, pp_rank), terms)


# What backward frees as it goes, layer by layer, while the gradients arrive.
FREED_IN_BACKWARD = ("activations", "logits and cross-entropy", "bf16 weight copies (autocast)")


def gradients_fill_as_activations_free(layout: Layout) -> bool:
    """One replica, one pass, one stage: nothing holds a gradient from before the step's backward (no
    accumulation, no data-parallel buckets or FSDP reductions, no other microbatch's), so the blocks'
    gradients appear only as backward frees their activations (measured on an H200: the peak runs one
    gradient's size under activations + every gradient)."""
    return one_replica_one_stage(layout.parallel) and layout.accumulation_steps == 1


def one_replica_one_stage(parallel) -> bool:
    return parallel.data_parallel_path == "none" and parallel.zero == 0 and parallel.pp == 1


def output_layer_gradient_bytes(layout: Layout) -> float:
    """The gradients of the output layer (and the final norm), the first backward computes."""
    model = layout.model
    per_element = 4 if layout.keeps_fp32_master_parameters else 2
    return per_element * (model.vocab * model.dim + model.dim) / layout.parallel.tp


def gradients_held_at_the_peak(gradients: float, freed: float, first: float) -> float:
    """max(the output layer's gradients, all gradients − what backward frees)."""
    return max(min(first, gradients), gradients - freed)


def gradients_at_the_peak(layout: Layout, terms: list[Term]) -> list[Term]:
    """The gradients term as the peak holds it: the output layer's, the first backward computes, while every
    activation is still held; or, where the gradients outweigh the activations, all of them at the end of
    backward, the activations gone. Either way the terms sum to params + optimizer + max(A + G_out, G)."""
    gradients = next(term for term in terms if term.name == "gradients")
    freed = sum(term.value for term in terms if term.name in FREED_IN_BACKWARD)
    first = output_layer_gradient_bytes(layout)
    value = gradients_held_at_the_peak(gradients.value, freed, first)
    formula = (
        f"one replica, one pass: backward frees each block's activations as its gradients appear, so the peak "
        f"holds max(the output layer's gradients, all gradients − what backward frees) = "
        f"max({count(round(first))}, {count(round(gradients.value))} − {count(round(freed))}) B"
    )
    return [Term("gradients", value, formula) if term is gradients else term for term in terms]


def memory_per_rank(layout: Layout) -> list[RankMemory]:
    return [rank_memory(layout, pp_rank) for pp_rank in range(layout.pipeline_ranks)]


def rank_coordinates(parallel, rank: int) -> dict[str, int]:
    """A global rank's place in the mesh: tp innermost, then cp, dp_shard, dp_replicate, pp."""
    coordinates = {}
    for dim in PLACEMENT:
        size = getattr(parallel, dim)
        coordinates[dim] = rank % size
        rank //= size
    return coordinates


def state_bytes_of_rank(layout: Layout, rank: int) -> dict[str, int]:
    """The model-state bytes one global rank holds, as the trainer reports them after its first
    step (parameter_bytes, gradient_bytes, optimizer_bytes): FSDP's uneven chunks included."""
    where = rank_coordinates(layout.parallel, rank)
    shard_index = where["dp_shard"] * layout.parallel.cp + where["cp"]
    elements = rank_state_elements(layout, where["pp"], shard_index)
    terms = {term.name: int(term.value) for term in model_state_terms(layout, elements)}
    return {
        "parameter_bytes": terms["parameters"],
        "gradient_bytes": terms["gradients"],
        "optimizer_bytes": terms["optimizer states"],
    }
