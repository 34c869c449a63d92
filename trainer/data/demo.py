"""Byte-level training data from the Python standard library's own sources.

Every Python install ships the corpus, so a run needs no download. A step's global batch is a
pure function of (seed, step); data-parallel rank r of n takes its r-th slice. So a restarted run,
or the same run in another layout (one process with an n-times larger micro_batch included), sees
exactly the same data.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

from trainer.config import RunConfig
from trainer.data.order import batch_seed

THIRD_PARTY_DIRS = {"site-packages", "dist-packages"}


def stdlib_sources(root: Path | None = None) -> list[Path]:
    """The standard library's .py files, sorted by path relative to `root`, without site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    relative_paths: list[str] = []
    for directory, subdirectories, files in os.walk(root):
        # Pruned rather than filtered afterwards: site-packages can be far larger than the stdlib.
        subdirectories[:] = [name for name in subdirectories if name not in THIRD_PARTY_DIRS]
        relative_dir = Path(directory).relative_to(root)
        relative_paths.extend((relative_dir / name).as_posix() for name in files if name.endswith(".py"))
    return [root / relative for relative in sorted(relative_paths)]


def load_corpus(max_bytes: int, root: Path | None = None) -> torch.Tensor:
    """The concatenated sources, truncated to max_bytes, as a uint8 tensor of byte tokens."""
    chunks: list[bytes] = []
    remaining = max_bytes
    for path in stdlib_sources(root):
        if remaining <= 0:
            break
        chunk = path.read_bytes()[:remaining]
        chunks.append(chunk)
        remaining -= len(chunk)
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


class WindowSampler:
    """Draws a step's global batch of random windows of seq_len + 1 tokens; each data-parallel rank
    takes micro_batch of them."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, micro_batch: int, seed: int):
        if tokens.numel() < seq_len + 1:
            raise ValueError(
                f"the corpus holds {tokens.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
                "raise data.corpus_bytes or lower model.seq_len"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.seed = seed
        self._offsets = torch.arange(seq_len + 1)

    @classmethod
    def from_config(cls, config: RunConfig) -> WindowSampler:
        tokens = load_corpus(config.data.corpus_bytes)
        return cls(tokens, config.model.seq_len, config.data.micro_batch, config.data.seed)

    def batch(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 [micro_batch, seq_len]; targets are inputs shifted left by one."""
        generator = torch.Generator().manual_seed(batch_seed(self.seed, step))
        last_start = self.tokens.numel() - (self.seq_len + 1)
        global_starts = torch.randint(0, last_start + 1, (self.micro_batch * dp_size,), generator=generator)
        starts = global_starts[dp_rank * self.micro_batch : (dp_rank + 1) * self.micro_batch]
        windows = self.tokens[starts[:, None] + self._offsets].long()
        return windows[:, :-1], windows[:, 1:]
