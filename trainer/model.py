"""A Llama-style decoder: RMSNorm, rotary position embeddings, grouped-query attention, SwiGLU (or, with
model.mlp gelu, GPT-3's two-matrix GELU feed-forward block; with model.experts > 1, a mixture of experts: moe.py);
with model.parallel_blocks, attention and the feed-forward block side by side in each block, as GPT-J's and PaLM's.

The model holds no parallelism; trainer.parallel applies it from outside. Pipeline stages are copies
of this model with the parts other stages own set to None, so every parameter keeps its name.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import NORM_EPS, ROPE_BASE, ModelConfig, RopeScaling
from trainer.dense import dense_feed_forward
from trainer.kernels import TORCH_KERNELS, KernelSet
from trainer.moe import MoEFeedForward

INIT_STD = 0.02


def rotary_tables(
    seq_len: int, head_dim: int, base: float = ROPE_BASE, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [seq_len, head_dim], laid out for the rotate-half formulation."""
    inverse_frequencies = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is not None:
        inverse_frequencies = scaled_frequencies(inverse_frequencies, scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inverse_frequencies)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def scaled_frequencies(frequencies: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1's rescaling: short wavelengths kept, long ones divided by the factor, a linear blend of the
    two (in original_context / wavelength) between them."""
    wavelengths = 2 * math.pi / frequencies
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    blend = ((scaling.original_context / wavelengths - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - blend) * frequencies / scaling.factor + blend * frequencies


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight, through the fused kernel when one is selected."""

    def __init__(self, dim: int, kernels: KernelSet, eps: float = NORM_EPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [B, H, T, D], k and v [B, H_kv, T, D] with H a multiple of H_kv (grouped-query attention)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """causal_attention within documents: `allowed` [B, 1, T, T] says which keys each query may see."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=k.shape[1] != q.shape[1])


def document_mask(tokens: torch.Tensor, eot_id: int) -> torch.Tensor:
    """[B, 1, T, T]: query t sees key u when u <= t and both lie in one document. An end-of-text token belongs
    to the document it ends, so the token after it starts the next one afresh."""
    ends = tokens == eot_id
    documents = ends.cumsum(dim=1) - ends.long()
    same_document = documents[:, :, None] == documents[:, None, :]
    seq_len = tokens.shape[1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=tokens.device).tril()
    return (same_document & causal)[:, None]


class Attention(nn.Module):
    """Causal self-attention; kv_heads < heads shares each key/value head among a group of query heads."""

    def __init__(self, cfg: ModelConfig, kernels: KernelSet):
        super().__init__()
        self.kernels = kernels
        self.head_dim = cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)
        # How queries meet keys and values; context parallelism swaps in one that gathers them across ranks.
        self.attend = causal_attention

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [B, T, dim]; cos/sin cover at least T positions; `allowed` a document mask (document_mask) or None
        for plain causal attention. Head counts are read from the projections' outputs (-1), so the same code
        runs on a tensor-parallel shard of the heads."""
        batch, seq_len, _ = x.shape
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = cos[:seq_len], sin[:seq_len]
        q, k = self.kernels.rotary(q, cos, sin), self.kernels.rotary(k, cos, sin)
        out = self.attend(q, k, v) if allowed is None else document_attention(q, k, v, allowed)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


def feed_forward(cfg: ModelConfig, kernels: KernelSet, index: int) -> nn.Module:
    """Block `index`'s feed-forward: a mixture of experts, or dense (every block of a dense model, the first
    moe.dense_layers of a mixture of experts)."""
    return MoEFeedForward(cfg, kernels) if cfg.is_moe_block(index) else dense_feed_forward(cfg.dense_blocks, kernels)


class Block(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then x + mlp(norm(x)). With model.parallel_blocks the two
    sit side by side on one norm's output (GPT-J, PaLM): x + attention(norm(x)) + mlp(norm(x)), and the block has
    no mlp_norm."""

    def __init__(self, cfg: ModelConfig, kernels: KernelSet, index: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, kernels, cfg.norm_eps)
        self.attention = Attention(cfg, kernels)
        self.mlp_norm: RMSNorm | None = None if cfg.parallel_blocks else RMSNorm(cfg.dim, kernels, cfg.norm_eps)
        self.mlp = feed_forward(cfg, kernels, index)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor | None = None
    ) -> torch.Tensor:
        normed = self.attention_norm(x)
        # `allowed` goes by keyword: tensor parallelism's input plan covers the positional inputs only.
        attended = self.attention(normed, cos, sin, allowed=allowed)
        if self.mlp_norm is None:
            return x + attended + self.mlp(normed)
        x = x + attended
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Token embedding, `layers` blocks, final RMSNorm and a projection to the vocabulary: its own matrix, or with
    model.tie_embeddings the embedding's (one parameter, named embedding.weight and output.weight both)."""

    def __init__(self, cfg: ModelConfig, kernels: KernelSet = TORCH_KERNELS):
        super().__init__()
        self.cfg = cfg
        self.kernels = kernels
        self.embedding: nn.Embedding | None = nn.Embedding(cfg.vocab, cfg.dim)
        # A dict keyed by layer number: a pipeline stage deletes the layers it does not own and the
        # rest keep their names (blocks.7.…), so checkpoints and comparisons line up across layouts.
        self.blocks = nn.ModuleDict({str(index): Block(cfg, kernels, index) for index in range(cfg.layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, kernels, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.tie_output()
        cos, sin = rotary_tables(cfg.seq_len, cfg.dim // cfg.heads, cfg.rope_theta, cfg.rope_scaling)
        # Non-persistent: derived from the config, so checkpoints need not carry them.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # data.document_mask: the end-of-text token whose documents attention keeps apart (None: plain causal).
        self.document_end: int | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, 0.02) weights; projections that write into the residual stream are scaled
        by 1/sqrt(2·layers) so the stream's variance does not grow with depth."""
        residual_std = INIT_STD / math.sqrt(2 * self.cfg.layers)
        for name, parameter in self.named_parameters():
            if parameter.dim() < 2:
                continue
            is_residual_projection = name.endswith(
                ("attention.wo.weight", "mlp.w2.weight", "mlp.experts.w2", "mlp.shared.w2.weight")
            )
            nn.init.normal_(parameter, mean=0.0, std=residual_std if is_residual_projection else INIT_STD)

    def tie_output(self) -> None:
        """With tied embeddings, make the output layer use the embedding's parameter; again after parallelism has
        replaced one of them (both are split over the vocabulary, so their placements agree)."""
        if self.cfg.tie_embeddings and self.embedding is not None and self.output is not None:
            self.output.weight = self.embedding.weight

    def use_kernels(self, kernels: KernelSet) -> None:
        """Switch every fused op of the model to another implementation (same results)."""
        for module in self.modules():
            if hasattr(module, "kernels"):
                module.kernels = kernels

    def num_params(self) -> int:
        return sum(parameter.numel() for parameter in self.parameters())

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] int64 with T <= seq_len -> logits [B, T, vocab], or with targets [B, T] the
        mean cross-entropy, computed in chunks so the full fp32 logits never exist.

        A pipeline stage without the embedding takes hidden states [B, T, dim] instead, and one
        without the output projection returns them."""
        if tokens.shape[1] > self.cfg.seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens is longer than model.seq_len={self.cfg.seq_len}")
        allowed = None
        if self.document_end is not None:
            # Built from the token ids, which only the stage holding the embedding sees (the config refuses pp).
            allowed = document_mask(tokens, self.document_end)
        x = self.embedding(tokens) if self.embedding is not None else tokens
        for block in self.blocks.values():
            x = block(x, self.rope_cos, self.rope_sin, allowed=allowed)
        if self.norm is not None:
            x = self.norm(x)
        if self.output is None:
            return x
        if targets is not None:
            return self.kernels.cross_entropy(x, self.output.weight, targets)
        return self.output(x)
