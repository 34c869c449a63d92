"""The dense feed-forward blocks: SwiGLU (Llama) and GPT-3's GELU block; also a mixture of experts' shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig
from trainer.kernels import KernelSet


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): a gated feed-forward block."""

    def __init__(self, cfg: ModelConfig, kernels: KernelSet):
        super().__init__()
        self.kernels = kernels
        self.w1 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.kernels.swiglu(self.w1(x), self.w3(x)))


class GELUFeedForward(nn.Module):
    """w2(gelu(w1 x)), with GELU's tanh approximation, as GPT-2 and GPT-3 trained: PyTorch runs it as one kernel."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


def dense_feed_forward(cfg: ModelConfig, kernels: KernelSet) -> nn.Module:
    return SwiGLU(cfg, kernels) if cfg.mlp == "swiglu" else GELUFeedForward(cfg)
