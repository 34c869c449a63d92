"""The mixture-of-experts feed-forward block: a router picks model.top_k of model.experts SwiGLU (or GELU) experts
for every token, the experts run on the tokens sent to them, and the gates weight what comes back; a shared
expert (model.moe.shared_expert), a dense block of the same size, takes every token besides.

Routing is dropless unless model.moe.capacity_factor caps what an expert takes from one sequence. Tokens are
sorted by expert (stably, so ties and order are the same in every layout) and each expert multiplies its rows
in one grouped GEMM where PyTorch has one for the shapes, a loop over experts otherwise.

Balance is kept per sequence, so it is the same whatever splits the batch (data parallelism, microbatches,
gradient accumulation): DeepSeek-V3's sequence-wise auxiliary loss, whose gradient is handed to the router in
the backward pass (the training loss stays the language-model loss), and optionally its auxiliary-loss-free
bias, which shifts which experts are chosen towards equal load.

No parallelism lives here. Expert parallelism replaces `dispatch` (tokens travel to the ranks holding their
experts and back); context and tensor parallelism replace `whole_sequences` (a sequence's totals add up over its
ranks); tensor parallelism also `gather_sequence` and `reduce_sequence` (the experts' slices take every token).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from trainer.config import ModelConfig
from trainer.dense import dense_feed_forward
from trainer.kernels import KernelSet


class Router(nn.Module):
    """Scores every expert for every token and chooses top_k: the highest scores plus the balancing bias, ties to
    the lower expert index. Gates are the chosen experts' probabilities, renormalised over them if configured."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = cfg.moe.gate
        self.renormalize = cfg.moe.renormalize
        self.weight = nn.Parameter(torch.empty(cfg.experts, cfg.dim))
        # Learned by load counting, not by gradients; checkpointed with the model.
        self.register_buffer("expert_bias", torch.zeros(cfg.experts))

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens [N, dim] -> (probabilities [N, E] fp32, chosen experts [N, k], gates [N, k] fp32)."""
        scores = F.linear(tokens, _local(self.weight).to(tokens.dtype)).float()
        probabilities = scores.softmax(dim=-1) if self.gate == "softmax" else scores.sigmoid()
        preference = probabilities.detach() + self.expert_bias
        chosen = preference.sort(dim=-1, descending=True, stable=True).indices[:, : self.top_k]
        gates = probabilities.gather(1, chosen)
        if self.renormalize:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        return probabilities, chosen, gates


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype matrix products on `tensor` run in: autocast's where it is on (it does not cover torch._grouped_mm,
    so the block casts for it), else the tensor's own."""
    device = tensor.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else tensor.dtype


def grouped_matmul(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """rows [n, in] grouped by expert (counts[e] rows each, in expert order) times weight [E, out, in]ᵀ -> [n, out]."""
    weight = weight.to(rows.dtype).transpose(-2, -1)
    if _grouped_mm_takes(rows, weight):
        return torch._grouped_mm(rows, weight, offs=counts.cumsum(0).to(torch.int32))
    pieces = rows.split(counts.tolist())
    return torch.cat([piece @ weight[expert] for expert, piece in enumerate(pieces)])


def _grouped_mm_takes(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch._grouped_mm needs 16-byte aligned strides; on CUDA it runs bf16 on Hopper or later only."""
    aligned = all((size * rows.element_size()) % 16 == 0 for size in (rows.shape[-1], weight.shape[-1]))
    if rows.device.type == "cuda":
        return aligned and rows.dtype == torch.bfloat16 and torch.cuda.get_device_capability(rows.device)[0] >= 9
    return aligned and rows.device.type == "cpu" and rows.shape[0] > 0


class GroupedExperts(nn.Module):
    """E feed-forward experts as three (GELU: two) stacked weights, named as the planner names them."""

    def __init__(self, cfg: ModelConfig, kernels: KernelSet):
        super().__init__()
        self.kernels = kernels
        self.gated = cfg.mlp == "swiglu"
        self.w1 = nn.Parameter(torch.empty(cfg.experts, cfg.ffn, cfg.dim))
        if self.gated:
            self.w3 = nn.Parameter(torch.empty(cfg.experts, cfg.ffn, cfg.dim))
        self.w2 = nn.Parameter(torch.empty(cfg.experts, cfg.dim, cfg.ffn))

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [n, dim] sorted by expert, counts [E] how many each expert takes -> outputs [n, dim], same order."""
        up = grouped_matmul(rows, _local(self.w1), counts)
        if self.gated:
            hidden = self.kernels.swiglu(up, grouped_matmul(rows, _local(self.w3), counts))
        else:
            hidden = F.gelu(up, approximate="tanh")
        return grouped_matmul(hidden, _local(self.w2), counts)


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's part of a weight the parallel code holds as a DTensor: expert parallelism splits the experts over
    its ranks, tensor parallelism their hidden columns and replicates the router. A replicated weight here only
    ever computes on this rank's share of the tokens, so its gradient is a partial sum over the ranks."""
    if not isinstance(weight, DTensor):
        return weight
    return weight.to_local(grad_placements=[Partial() if p.is_replicate() else p for p in weight.placements])


class _BalanceLossGradient(torch.autograd.Function):
    """Identity on the block's output; in the backward pass it also starts the balance loss's own backward (with
    gradient 1), so the loss trains the router without being added to the language-model loss."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, balance_loss: torch.Tensor) -> torch.Tensor:
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad_output, torch.ones((), device=grad_output.device)


def _in_backward() -> bool:
    # Activation checkpointing reruns forwards inside the backward pass: they must not count tokens twice.
    return torch._C._current_graph_task_id() != -1


class MoEFeedForward(nn.Module):
    """The mixture-of-experts block that replaces the dense feed-forward block; see the module docstring.

    Since the last `take_statistics()`, `load` counts the tokens routed to each expert (after capacity),
    `dropped` the token copies capacity turned away and `balance_losses` the unweighted balance loss of each
    forward pass."""

    def __init__(self, cfg: ModelConfig, kernels: KernelSet):
        super().__init__()
        self.experts_count = cfg.experts
        self.top_k = cfg.top_k
        self.settings = cfg.moe
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg, kernels)
        self.shared = dense_feed_forward(cfg, kernels) if cfg.moe.shared_expert else None
        # Sends rows sorted by expert to the experts and returns their outputs in the same order; None: this
        # module's own experts take them.
        self.dispatch: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        # Adds up per-sequence totals [B, …] over the ranks that hold parts of the same sequences.
        self.whole_sequences: Callable[[torch.Tensor], torch.Tensor] = _unchanged
        # Under tensor parallelism this rank holds part of every sequence and a slice of every expert: the router
        # runs on its own tokens, the experts on all of them. gather_sequence joins the ranks' parts [B, T_part, …]
        # into [B, T, …]; reduce_sequence adds up the ranks' partial outputs [B, T, dim] and keeps this rank's part.
        self.gather_sequence: Callable[[torch.Tensor], torch.Tensor] = _unchanged
        self.reduce_sequence: Callable[[torch.Tensor], torch.Tensor] = _unchanged
        # Ranks that compute the same balance loss and add up its gradients (tensor parallelism's).
        self.balance_loss_copies = 1
        # What the balance loss counts for in this pass (the step sets 1/passes, like the language-model loss's).
        self.balance_loss_scale = 1.0
        self.counting = True
        self.load = torch.zeros(cfg.experts, dtype=torch.long)
        self.dropped = 0
        self.balance_losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, dim = x.shape
        probabilities, chosen, gates = self.router(x.reshape(-1, dim))
        tokens = self.gather_sequence(x).reshape(-1, dim)
        whole_chosen = self.gather_sequence(chosen.view(batch, seq_len, -1))
        whole_len = whole_chosen.shape[1]
        whole_gates = self.gather_sequence(gates.view(batch, seq_len, -1)).reshape(-1, self.top_k)
        copies = whole_chosen.flatten()
        order = copies.argsort(stable=True)
        if self.settings.capacity_factor is not None:
            kept = self._within_capacity(whole_chosen.reshape(batch, -1), whole_len).flatten()
            order = order[kept[order]]
        counts = torch.bincount(copies[order], minlength=self.experts_count)
        dtype = compute_dtype(tokens)
        outputs = (self.dispatch or self.experts)(tokens[order // self.top_k].to(dtype), counts)
        combined = self._combine(outputs, order, whole_gates.to(dtype)).view(batch, whole_len, dim)
        combined = self.reduce_sequence(combined)
        if self.shared is not None:
            combined = combined + self.shared(x)
        # Training forwards only: not evaluation, and not a forward activation checkpointing reruns in backward.
        counts_this_pass = self.counting and torch.is_grad_enabled() and not _in_backward()
        if counts_this_pass:
            self._count(counts, copies.numel() - order.numel())
        if torch.is_grad_enabled() and self.settings.balance_loss > 0:
            balance = self._balance_loss(probabilities.view(batch, seq_len, -1), chosen.reshape(batch, -1))
            if counts_this_pass:
                self.balance_losses.append(balance.detach())
            weight = self.settings.balance_loss * self.balance_loss_scale / self.balance_loss_copies
            combined = _BalanceLossGradient.apply(combined, balance * weight)
        return combined

    def _combine(self, outputs: torch.Tensor, order: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """Each token's expert outputs (sorted by expert, in `order`), weighted by its gates [N, k] and added up:
        one batched product over the token's k copies, which keeps for backward only them, gates and an index (a
        copy capacity dropped contributes zeros)."""
        tokens, k = gates.shape
        position = torch.full((tokens * k,), len(order), dtype=order.dtype, device=order.device)
        position[order] = torch.arange(len(order), device=order.device)
        if len(order) < tokens * k:
            outputs = torch.cat([outputs, outputs.new_zeros(1, outputs.shape[-1])])
        per_token = outputs[position].view(tokens, k, -1)
        return torch.bmm(gates.unsqueeze(1), per_token).squeeze(1)

    def _within_capacity(self, chosen: torch.Tensor, seq_len: int) -> torch.Tensor:
        """[B, T·k] bool: the token copies each expert takes from its sequence, first come first served."""
        capacity = math.ceil(self.settings.capacity_factor * seq_len * self.top_k / self.experts_count)
        one_hot = F.one_hot(chosen, self.experts_count)
        place_in_expert = (one_hot.cumsum(dim=1) * one_hot).sum(dim=-1)
        return place_in_expert <= capacity

    def _balance_loss(self, probabilities: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss, Σ_e f_e · P_e averaged over sequences: f_e is expert e's share
        of the sequence's token copies times E / top_k (1 when even), P_e its mean normalised router probability.
        1 when the load is even, up to E / top_k when it all goes to top_k experts."""
        batch, seq_len, experts = probabilities.shape
        affinity = probabilities / probabilities.sum(dim=-1, keepdim=True)
        picks = torch.zeros(batch, experts, device=chosen.device).scatter_add_(
            1, chosen, torch.ones(chosen.shape, device=chosen.device)
        )
        tokens = torch.full((batch, 1), float(seq_len), device=chosen.device)
        totals = self.whole_sequences(torch.cat([picks, affinity.sum(dim=1), tokens], dim=1))
        picks, affinity_sums, tokens = totals.split([experts, experts, 1], dim=1)
        share = picks * experts / (self.top_k * tokens)
        return (share * affinity_sums / tokens).sum(dim=-1).mean()

    def _count(self, counts: torch.Tensor, dropped: int) -> None:
        self.load = self.load.to(counts.device) + counts
        self.dropped += dropped

    def take_statistics(self) -> tuple[torch.Tensor, int, list[float]]:
        """(load, dropped, balance losses) since the last call, and start counting afresh."""
        taken = (self.load, self.dropped, [float(loss) for loss in self.balance_losses])
        self.load = torch.zeros_like(self.load)
        self.dropped = 0
        self.balance_losses = []
        return taken


def _unchanged(totals: torch.Tensor) -> torch.Tensor:
    return totals


@contextlib.contextmanager
def statistics_paused(module: nn.Module) -> Iterator[None]:
    """Forward passes within leave the load statistics of the module's MoE blocks alone."""
    blocks = [moe for moe in module.modules() if isinstance(moe, MoEFeedForward)]
    for moe in blocks:
        moe.counting = False
    try:
        yield
    finally:
        for moe in blocks:
            moe.counting = True
