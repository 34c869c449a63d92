"""The model's parameter tensors, where each pipeline stage holds them, and how tensor, expert and
FSDP sharding cut them: exactly the local shards the trainer's ranks hold.

Shapes follow trainer/model.py (nn.Linear weights are [out, in]); tensor parallelism follows
trainer/parallel/tensor.py (q/k/v, w1/w3 and the output split by rows, wo and w2 by columns,
the embedding by vocabulary rows, norms replicated); FSDP2 then cuts dim 0 of each tensor-parallel
shard into sharding_ranks chunks the way torch.chunk does (ceil-sized, the last ones shorter or empty).

Blocks come in at most two kinds (`BlockKind`): a mixture of experts' first moe.dense_layers blocks are dense, the
rest route to experts; every block of a kind holds the same tensors, so what a rank holds is priced per kind of
tensor (`held_tensors`: each of a kind's tensors once, with the number of its blocks as its copies) rather than
per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, partial

from trainer.config import V_SCHEDULES, ComputeConfig, ModelConfig, ParallelConfig
from trainer.pipeline_split import stage_block_counts, stage_blocks


@dataclass(frozen=True)
class ParameterTensor:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None = None
    """The dim tensor parallelism splits, or None where every tp rank holds it whole."""
    expert: bool = False
    """One slice per expert along dim 0, which expert parallelism splits."""
    copies: int = 1
    """Identical tensors this one stands for: the blocks held, where a list is by kind (`held_tensors`)."""

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


def block_tensors(model: ModelConfig, layer: int | str, copies: int = 1) -> list[ParameterTensor]:
    """One block's tensors; `layer` is its index, or "*" where they stand for `copies` blocks."""
    h, head_dim = model.dim, model.dim // model.heads
    prefix = f"blocks.{layer}"
    tensor = partial(ParameterTensor, copies=copies)
    tensors = [
        tensor(f"{prefix}.attention_norm.weight", (h,)),
        tensor(f"{prefix}.attention.wq.weight", (model.heads * head_dim, h), tp_dim=0),
        tensor(f"{prefix}.attention.wk.weight", (model.kv_heads * head_dim, h), tp_dim=0),
        tensor(f"{prefix}.attention.wv.weight", (model.kv_heads * head_dim, h), tp_dim=0),
        tensor(f"{prefix}.attention.wo.weight", (h, model.heads * head_dim), tp_dim=1),
    ]
    if not model.parallel_blocks:
        # A parallel block's MLP reads the attention's norm: it has no norm of its own.
        tensors.append(tensor(f"{prefix}.mlp_norm.weight", (h,)))
    return tensors + mlp_tensors(model, f"{prefix}.mlp", copies)


def mlp_tensors(model: ModelConfig, prefix: str, copies: int = 1) -> list[ParameterTensor]:
    h, f = model.dim, model.ffn
    tensor = partial(ParameterTensor, copies=copies)
    if model.experts > 1:
        e = model.experts
        router = tensor(f"{prefix}.router.weight", (e, h))
        experts = [
            tensor(f"{prefix}.experts.w1", (e, f, h), tp_dim=1, expert=True),
            tensor(f"{prefix}.experts.w3", (e, f, h), tp_dim=1, expert=True),
            tensor(f"{prefix}.experts.w2", (e, h, f), tp_dim=2, expert=True),
        ]
        routed = [router] + (experts if model.mlp == "swiglu" else [experts[0], experts[2]])
        shared = dense_mlp_tensors(model, f"{prefix}.shared", copies) if model.moe.shared_expert else []
        return routed + shared
    return dense_mlp_tensors(model, prefix, copies)


def dense_mlp_tensors(model: ModelConfig, prefix: str, copies: int = 1) -> list[ParameterTensor]:
    h, f = model.dim, model.ffn
    tensor = partial(ParameterTensor, copies=copies)
    up = [tensor(f"{prefix}.w1.weight", (f, h), tp_dim=0)]
    if model.mlp == "swiglu":
        up.append(tensor(f"{prefix}.w3.weight", (f, h), tp_dim=0))
    return up + [tensor(f"{prefix}.w2.weight", (h, f), tp_dim=1)]


def stage_layers(model: ModelConfig, stages: int, stage: int) -> range:
    return stage_blocks(model.layers, stages, stage)


@dataclass(frozen=True)
class BlockKind:
    """Blocks of one kind that pipeline stages hold."""

    model: ModelConfig
    """The config its blocks follow: the model's, or for a mixture of experts' dense blocks `dense_blocks`."""
    indices: tuple[int, ...]

    @property
    def layers(self) -> int:
        return len(self.indices)

    def recomputed(self, compute: ComputeConfig) -> int:
        """Of these blocks, those that recompute (every N-th with compute.recompute_every N)."""
        if compute.recompute == "none":
            return 0
        return sum(compute.recomputes_block(index) for index in self.indices)


def held_block_kinds(model: ModelConfig, total_stages: int, stages: list[int]) -> list[BlockKind]:
    """The blocks these stages hold, by kind (the dense ones first); a kind none of them holds is left out, but a
    dense model's blocks are one kind even when there are none."""
    indices = [index for stage in stages for index in stage_blocks(model.layers, total_stages, stage)]
    if model.experts == 1:
        return [BlockKind(model, tuple(indices))]
    dense = tuple(index for index in indices if not model.is_moe_block(index))
    routed = tuple(index for index in indices if model.is_moe_block(index))
    kinds = [BlockKind(model.dense_blocks, dense), BlockKind(model, routed)]
    return [kind for kind in kinds if kind.indices]


def block_kinds(model: ModelConfig) -> list[BlockKind]:
    """Every block of the model, by kind."""
    return held_block_kinds(model, 1, [0])


def held_layers(model: ModelConfig, total_stages: int, stages: list[int]) -> int:
    """Blocks these pipeline stages hold between them (trainer.pipeline_split)."""
    counts = stage_block_counts(model.layers, total_stages)
    return sum(counts[stage] for stage in stages)


def embedding_tensor(model: ModelConfig) -> ParameterTensor:
    return ParameterTensor("embedding.weight", (model.vocab, model.dim), tp_dim=0)


def last_stage_tensors(model: ModelConfig, total_stages: int) -> list[ParameterTensor]:
    """The final norm and the output. With tied embeddings and more than one stage, the last stage
    keeps its own copy of the embedding matrix as the output (Megatron-LM does the same and
    all-reduces the two copies' gradients)."""
    tensors = [ParameterTensor("norm.weight", (model.dim,))]
    if not model.tie_embeddings or total_stages > 1:
        tensors.append(ParameterTensor("output.weight", (model.vocab, model.dim), tp_dim=0))
    return tensors


def stage_tensors(model: ModelConfig, stages: int, stage: int) -> list[ParameterTensor]:
    """What one pipeline stage holds, every tensor by its name in trainer/model.py."""
    tensors = [embedding_tensor(model)] if stage == 0 else []
    for layer in stage_layers(model, stages, stage):
        tensors += block_tensors(model, layer)
    if stage == stages - 1:
        tensors += last_stage_tensors(model, stages)
    return tensors


def held_tensors(model: ModelConfig, total_stages: int, stages: list[int]) -> list[ParameterTensor]:
    """What these pipeline stages hold between them, by kind: the tensors of `stage_tensors`, each of
    a block's tensors once with the blocks held as its copies."""
    tensors = [embedding_tensor(model)] if 0 in stages else []
    for kind in held_block_kinds(model, total_stages, stages):
        if kind.layers:
            tensors += block_tensors(kind.model, "*", copies=kind.layers)
    if total_stages - 1 in stages:
        tensors += last_stage_tensors(model, total_stages)
    return tensors


def pipeline_stages(parallel: ParallelConfig) -> int:
    """Stages the model is cut into: pp × stages_per_rank, which counts only with a pipeline (pp > 1)."""
    return parallel.pp * (parallel.stages_per_rank if parallel.pp > 1 else 1)


def stages_of_rank(parallel: ParallelConfig, pp_rank: int) -> list[int]:
    """Looped placement (r, r+p, …) or, for V schedules, r and 2p−1−r (trainer/parallel/pipeline.py)."""
    pp = parallel.pp
    if parallel.pp > 1 and parallel.pp_schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(parallel.stages_per_rank if pp > 1 else 1)]


def rank_tensors(model: ModelConfig, parallel: ParallelConfig, pp_rank: int) -> list[ParameterTensor]:
    """Every tensor pipeline rank `pp_rank` holds, by name."""
    stages = pipeline_stages(parallel)
    tensors: list[ParameterTensor] = []
    for stage in stages_of_rank(parallel, pp_rank):
        tensors += stage_tensors(model, stages, stage)
    return tensors


@dataclass(frozen=True)
class RankHolding:
    """What one pipeline rank holds under its layout's stage placement."""

    stages: list[int]
    kinds: list[BlockKind]
    holds_embedding: bool
    holds_output: bool
    tensors: list[ParameterTensor]
    """By kind (`held_tensors`)."""

    @cached_property
    def layers(self) -> int:
        return sum(kind.layers for kind in self.kinds)

    def layers_like(self, kind: BlockKind) -> int:
        """Blocks of `kind`'s kind (dense, or a mixture of experts) this rank holds."""
        return sum(held.layers for held in self.kinds if held.model.experts == kind.model.experts)

    @cached_property
    def signature(self) -> tuple[tuple[tuple[bool, int], ...], bool, bool]:
        """Ranks that agree on it hold the same tensors and compute, send and keep the same
        (their microbatches in flight aside)."""
        blocks = tuple((kind.model.experts > 1, kind.layers) for kind in self.kinds)
        return blocks, self.holds_embedding, self.holds_output


def rank_holding(model: ModelConfig, parallel: ParallelConfig, pp_rank: int) -> RankHolding:
    stages = stages_of_rank(parallel, pp_rank)
    total_stages = pipeline_stages(parallel)
    return RankHolding(
        stages=stages,
        kinds=held_block_kinds(model, total_stages, stages),
        holds_embedding=0 in stages,
        holds_output=total_stages - 1 in stages,
        tensors=held_tensors(model, total_stages, stages),
    )


def chunk_rows(rows: int, chunks: int, index: int) -> int:
    """Rows of chunk `index` when torch.chunk cuts `rows` into `chunks` (what FSDP2 does)."""
    size = -(-rows // chunks)
    return max(0, min(size, rows - index * size))


def local_elements(tensor: ParameterTensor, parallel: ParallelConfig, sharded: bool, shard_index: int = 0) -> int:
    """Elements of `tensor` on one rank: tp and ep split their dims evenly (the config guarantees it);
    when `sharded` (parameters under ZeRO-3, gradients from ZeRO-2, optimizer states from ZeRO-1),
    dim 0 of what is left is cut over the sharding ranks, and shard_index 0 holds the largest chunk."""
    shape = list(tensor.shape)
    if tensor.tp_dim is not None:
        shape[tensor.tp_dim] //= parallel.tp
    sharding_ranks = parallel.sharding_ranks
    if tensor.expert:
        shape[0] //= parallel.ep
        sharding_ranks = max(1, sharding_ranks // parallel.ep)
        shard_index %= sharding_ranks
    if sharded and sharding_ranks > 1:
        shape[0] = chunk_rows(shape[0], sharding_ranks, shard_index)
    return math.prod(shape)


def total_parameters(model: ModelConfig) -> int:
    """Every parameter once (tied embeddings counted once)."""
    return sum(tensor.copies * tensor.elements for tensor in held_tensors(model, 1, [0]))


def embedding_parameters(model: ModelConfig) -> int:
    return model.vocab * model.dim


def active_parameters(model: ModelConfig) -> int:
    """Parameters one token's forward pass multiplies with: each MoE layer uses top_k experts."""
    total = total_parameters(model)
    if model.experts == 1:
        return total
    moe_layers = model.layers - model.moe.dense_layers
    expert_elements = sum(t.elements for t in mlp_tensors(model, "mlp") if t.expert) * moe_layers
    return total - expert_elements + expert_elements * model.top_k // model.experts
