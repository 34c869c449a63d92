"""Context parallelism: the sequence split over cp ranks, keys and values all-gathered for attention.

Causal attention makes late tokens cost more than early ones, so the sequence is cut into 2·cp
chunks and rank r holds chunks r and 2·cp−1−r: every rank gets the same amount of work. Each rank
keeps its own queries, gathers every rank's keys and values (the all-gather-KV variant; its backward
is a reduce-scatter), and masks by global positions. Plain collectives, so it runs on gloo as on NCCL."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_gather_tensor_autograd
from torch.distributed.device_mesh import DeviceMesh

from trainer.model import Transformer


def load_balanced_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """The global positions rank cp_rank holds: chunk cp_rank, then chunk 2·cp−1−cp_rank."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)
    return torch.cat([first, second])


class GatheredKeyValueAttention:
    """Causal attention of local queries over the keys and values of every cp rank."""

    def __init__(self, cp_mesh: DeviceMesh, seq_len: int):
        cp = cp_mesh.size()
        self.group = cp_mesh.get_group()
        self.local_positions = load_balanced_positions(seq_len, cp, cp_mesh.get_local_rank())
        # all_gather stacks ranks in order, so the gathered keys sit at these global positions.
        self.gathered_positions = torch.cat([load_balanced_positions(seq_len, cp, rank) for rank in range(cp)])

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k = all_gather_tensor_autograd(k.contiguous(), gather_dim=2, group=self.group)
        v = all_gather_tensor_autograd(v.contiguous(), gather_dim=2, group=self.group)
        query_positions = self.local_positions.to(q.device)
        visible = query_positions[:, None] >= self.gathered_positions.to(q.device)[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=k.shape[1] != q.shape[1])


def apply_context_parallel(model: Transformer, cp_mesh: DeviceMesh) -> torch.Tensor:
    """Make the model attend across cp ranks and rotate by global positions; returns this rank's
    positions, which select its part of every sequence in the batch."""
    attention = GatheredKeyValueAttention(cp_mesh, model.cfg.seq_len)
    positions = attention.local_positions.to(model.rope_cos.device)
    model.register_buffer("rope_cos", model.rope_cos[positions], persistent=False)
    model.register_buffer("rope_sin", model.rope_sin[positions], persistent=False)
    for block in model.blocks.values():
        block.attention.attend = attention
    return attention.local_positions
