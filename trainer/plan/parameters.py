"""The model's parameter tensors, where each pipeline stage holds them, and how tensor, expert and
FSDP sharding cut them: exactly the local shards the trainer's ranks hold.

Shapes follow trainer/model.py (nn.Linear weights are [out, in]); tensor parallelism follows
trainer/parallel/tensor.py (q/k/v, w1/w3 and the output split by rows, wo and w2 by columns,
the embedding by vocabulary rows, norms replicated); FSDP2 then cuts dim 0 of each tensor-parallel
shard into sharding_ranks chunks the way torch.chunk does (ceil-sized, the last ones shorter or empty).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.config import V_SCHEDULES, ModelConfig, ParallelConfig


@dataclass(frozen=True)
class ParameterTensor:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None = None
    """The dim tensor parallelism splits, or None where every tp rank holds it whole."""
    expert: bool = False
    """One slice per expert along dim 0, which expert parallelism splits."""

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


def block_tensors(model: ModelConfig, layer: int) -> list[ParameterTensor]:
    h, head_dim = model.dim, model.dim // model.heads
    prefix = f"blocks.{layer}"
    tensors = [
        ParameterTensor(f"{prefix}.attention_norm.weight", (h,)),
        ParameterTensor(f"{prefix}.attention.wq.weight", (model.heads * head_dim, h), tp_dim=0),
        ParameterTensor(f"{prefix}.attention.wk.weight", (model.kv_heads * head_dim, h), tp_dim=0),
        ParameterTensor(f"{prefix}.attention.wv.weight", (model.kv_heads * head_dim, h), tp_dim=0),
        ParameterTensor(f"{prefix}.attention.wo.weight", (h, model.heads * head_dim), tp_dim=1),
        ParameterTensor(f"{prefix}.mlp_norm.weight", (h,)),
    ]
    return tensors + mlp_tensors(model, f"{prefix}.mlp")


def mlp_tensors(model: ModelConfig, prefix: str) -> list[ParameterTensor]:
    h, f = model.dim, model.ffn
    if model.experts > 1:
        e = model.experts
        router = ParameterTensor(f"{prefix}.router.weight", (e, h))
        experts = [
            ParameterTensor(f"{prefix}.experts.w1", (e, f, h), tp_dim=1, expert=True),
            ParameterTensor(f"{prefix}.experts.w3", (e, f, h), tp_dim=1, expert=True),
            ParameterTensor(f"{prefix}.experts.w2", (e, h, f), tp_dim=2, expert=True),
        ]
        return [router] + (experts if model.mlp == "swiglu" else [experts[0], experts[2]])
    up = [ParameterTensor(f"{prefix}.w1.weight", (f, h), tp_dim=0)]
    if model.mlp == "swiglu":
        up.append(ParameterTensor(f"{prefix}.w3.weight", (f, h), tp_dim=0))
    return up + [ParameterTensor(f"{prefix}.w2.weight", (h, f), tp_dim=1)]


def stage_layers(model: ModelConfig, stages: int, stage: int) -> range:
    per_stage = model.layers // stages
    return range(stage * per_stage, (stage + 1) * per_stage)


def stage_tensors(model: ModelConfig, stages: int, stage: int) -> list[ParameterTensor]:
    """What one pipeline stage holds. With tied embeddings and more than one stage, the last stage
    keeps its own copy of the embedding matrix as the output (Megatron-LM does the same and
    all-reduces the two copies' gradients)."""
    embedding = ParameterTensor("embedding.weight", (model.vocab, model.dim), tp_dim=0)
    tensors = [embedding] if stage == 0 else []
    for layer in stage_layers(model, stages, stage):
        tensors += block_tensors(model, layer)
    if stage == stages - 1:
        tensors.append(ParameterTensor("norm.weight", (model.dim,)))
        if not model.tie_embeddings or stages > 1:
            tensors.append(ParameterTensor("output.weight", (model.vocab, model.dim), tp_dim=0))
    return tensors


def stages_of_rank(parallel: ParallelConfig, pp_rank: int) -> list[int]:
    """Looped placement (r, r+p, …) or, for V schedules, r and 2p−1−r (trainer/parallel/pipeline.py)."""
    pp = parallel.pp
    if parallel.pp > 1 and parallel.pp_schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(parallel.stages_per_rank if pp > 1 else 1)]


def rank_tensors(model: ModelConfig, parallel: ParallelConfig, pp_rank: int) -> list[ParameterTensor]:
    stages = parallel.pp * (parallel.stages_per_rank if parallel.pp > 1 else 1)
    tensors: list[ParameterTensor] = []
    for stage in stages_of_rank(parallel, pp_rank):
        tensors += stage_tensors(model, stages, stage)
    return tensors


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
    return sum(tensor.elements for tensor in stage_tensors(model, 1, 0))


def embedding_parameters(model: ModelConfig) -> int:
    return model.vocab * model.dim


def active_parameters(model: ModelConfig) -> int:
    """Parameters one token's forward pass multiplies with: each MoE layer uses top_k experts."""
    total = total_parameters(model)
    if model.experts == 1:
        return total
    expert_elements = sum(t.elements for t in mlp_tensors(model, "mlp") if t.expert) * model.layers
    return total - expert_elements + expert_elements * model.top_k // model.experts
