"""Expert parallelism: each of the ep ranks of a group holds experts/ep of every MoE block's experts, and tokens
travel to the rank holding their expert and back with two all-to-alls (per-rank splits, so plain collectives that
run on gloo as on NCCL).

Where ep is smaller than dp_shard × cp, the ranks holding the same experts shard them with FSDP, as torchtitan
does. Each expert's gradient already sums what every rank of its ep group sent it, so it is divided by all the
data-parallel ranks, not only by those that hold that expert."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Placement, Shard, distribute_tensor

from trainer.config import ParallelConfig
from trainer.model import Transformer
from trainer.moe import GroupedExperts, MoEFeedForward

from .mesh import ParallelMesh


def moe_blocks(model: Transformer) -> list[MoEFeedForward]:
    return [block.mlp for block in model.blocks.values() if isinstance(block.mlp, MoEFeedForward)]


# Each expert weight's dim that holds its hidden columns, which tensor parallelism splits: w1 and w3 are
# [E, ffn, dim], w2 [E, dim, ffn].
HIDDEN_DIM = {"w1": 1, "w3": 1, "w2": 2}


def apply_expert_parallel(model: Transformer, experts_mesh: DeviceMesh) -> None:
    """Keep this rank's experts (a Shard(0) DTensor over "ep", and under tensor parallelism their columns split
    over "tp" too) and route tokens to the others' over all-to-alls."""
    ep_mesh = experts_mesh["ep"]
    split_columns = experts_mesh["tp"].size() > 1
    mesh = experts_mesh["ep", "tp"] if split_columns else ep_mesh
    for moe in moe_blocks(model):
        distribute_experts(moe, mesh, lambda name: [Shard(0), Shard(HIDDEN_DIM[name])] if split_columns else [Shard(0)])
        moe.dispatch = AllToAllDispatch(moe.experts, ep_mesh)


def distribute_experts(moe: MoEFeedForward, mesh: DeviceMesh, placements: Callable[[str], list[Placement]]) -> None:
    """Make each of the block's expert weights a DTensor over `mesh`, placed as `placements` says for its name."""
    for name, parameter in list(moe.experts.named_parameters()):
        distributed = distribute_tensor(parameter.data, mesh, placements(name))
        setattr(moe.experts, name, nn.Parameter(distributed, requires_grad=parameter.requires_grad))


def shard_experts(
    model: Transformer, experts_mesh: DeviceMesh, parallel: ParallelConfig, policy: MixedPrecisionPolicy
) -> None:
    """fully_shard each block's experts over the ranks that hold the same ones (HSDP across replicas), before the
    blocks are: their gradients are averaged over every data-parallel rank."""
    dims = ("expert_replicate", "expert_shard") if parallel.dp_replicate > 1 else ("expert_shard",)
    for moe in moe_blocks(model):
        fully_shard(
            moe.experts,
            mesh=experts_mesh[dims],
            mp_policy=policy,
            reshard_after_forward=parallel.reshards_after_forward,
        )
        moe.experts.set_gradient_divide_factor(float(parallel.data_parallel * parallel.cp))
        # A factor of its own makes FSDP pre-multiply in the reduce-scatter, which gloo cannot: summing and then
        # dividing runs on every backend. Not where each expert has one holder: there PyTorch 2.13 skips the
        # reduce-scatter, divides by the factor itself, and would divide a second time after it.
        moe.experts.set_force_sum_reduction_for_comms(parallel.sharding_ranks > parallel.ep)


class AllToAllDispatch:
    """MoEFeedForward.dispatch under expert parallelism. Rows arrive sorted by (global) expert; each rank's share
    goes to the rank holding those experts, which runs them grouped by its local expert and sends the outputs
    back in the order they came."""

    def __init__(self, experts: GroupedExperts, ep_mesh: DeviceMesh):
        self.experts = experts
        self.group = ep_mesh.get_group()
        self.ranks = ep_mesh.size()

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        local_experts = counts.numel() // self.ranks
        # received[r, e]: rows rank r sends to this rank's local expert e.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(self.ranks, local_experts)
        send_splits = counts.view(self.ranks, local_experts).sum(dim=1).tolist()
        receive_splits = received.sum(dim=1).tolist()
        arrived = all_to_all_single_autograd(rows, receive_splits, send_splits, self.group)
        expert_of_row = torch.arange(local_experts, device=rows.device).repeat(self.ranks)
        by_expert = expert_of_row.repeat_interleave(received.flatten()).argsort(stable=True)
        outputs = self.experts(arrived[by_expert], received.sum(dim=0))
        in_arrival_order = outputs[by_expert.argsort()]
        return all_to_all_single_autograd(in_arrival_order, send_splits, receive_splits, self.group)


def routing_step(modules: list[nn.Module], mesh: ParallelMesh, bias_update_rate: float) -> dict[str, dict]:
    """After a step's optimizer update: every MoE block's load over the whole global batch (summed over the ranks
    that saw different tokens), its dropped token copies and mean balance loss, keyed by layer; with a bias update
    rate, each expert's routing bias moved by it towards equal load (DeepSeek-V3: +rate under the mean load,
    −rate over it), the same on every rank."""
    blocks = [
        (layer, block.mlp)
        for module in modules
        for layer, block in module.blocks.items()
        if isinstance(block.mlp, MoEFeedForward)
    ]
    if not blocks:
        return {}
    taken = [moe.take_statistics() for _, moe in blocks]
    loads = torch.stack([load for load, _, _ in taken]).to(torch.float64)
    dropped = torch.tensor([float(count) for _, count, _ in taken], dtype=torch.float64, device=loads.device)
    totals = torch.cat([loads, dropped[:, None]], dim=1)
    dist.all_reduce(totals, group=mesh["dp_cp"].get_group())
    loads, dropped = totals[:, :-1], totals[:, -1]
    if bias_update_rate > 0:
        for (_, moe), load in zip(blocks, loads, strict=True):
            bias = moe.router.expert_bias
            bias += bias_update_rate * torch.sign(load.mean() - load).to(bias)
    return {
        str(layer): {
            "load": [int(count) for count in load.tolist()],
            "dropped": int(drops),
            "balance_loss": sum(losses) / len(losses) if losses else None,
        }
        for (layer, _), load, drops, (_, _, losses) in zip(blocks, loads, dropped.tolist(), taken, strict=True)
    }
