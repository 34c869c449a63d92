"""Byte-level training data from the Python standard library's own sources.

Every Python install ships the corpus, so a run needs no download. A step's global batch is a
pure function of (seed, step); data-parallel rank r of n takes its r-th slice. So a restarted run,
or the same run in another layout (one process with an n-times larger micro_batch included), sees
exactly the same data. The validation text is the standard library's bytes right after the training
corpus_bytes, so turning evaluation on changes nothing a run trains on.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

from trainer.config import ConfigError, RunConfig
from trainer.data.order import DataMismatch, batch_seed, validation_sequences

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


def load_corpus(max_bytes: int, root: Path | None = None, skip: int = 0) -> torch.Tensor:
    """The concatenated sources from byte `skip` on, truncated to max_bytes, as a uint8 tensor of byte tokens."""
    chunks: list[bytes] = []
    remaining = max_bytes
    for path in stdlib_sources(root):
        if remaining <= 0:
            break
        if skip > 0:
            size = path.stat().st_size
            if size <= skip:
                skip -= size
                continue
        chunk = path.read_bytes()[skip : skip + remaining]
        skip = 0
        chunks.append(chunk)
        remaining -= len(chunk)
    corpus = bytearray(b"".join(chunks))
    # frombuffer refuses an empty buffer; past the end of the standard library there is nothing to read.
    return torch.frombuffer(corpus, dtype=torch.uint8) if corpus else torch.zeros(0, dtype=torch.uint8)


def validation_bytes(config: RunConfig) -> int:
    """Bytes of the demo corpus's validation text: one window per evaluated sequence, windows k·seq_len apart."""
    sequences = config.eval.batches * config.sequences_per_pass
    return sequences * config.model.seq_len + 1


def load_validation(config: RunConfig) -> torch.Tensor:
    """The demo corpus's validation text: the standard library's bytes right after the training corpus_bytes."""
    return load_corpus(validation_bytes(config), skip=config.data.corpus_bytes)


def check_validation(config: RunConfig) -> None:
    """With evaluation on, the bytes beyond corpus_bytes must hold one sequence; ConfigError names the field."""
    window = config.model.seq_len + 1
    if config.eval.interval_steps and load_corpus(window, skip=config.data.corpus_bytes).numel() < window:
        raise ConfigError(
            {
                "eval.interval_steps": (
                    f"the standard library holds fewer than seq_len + 1 = {window} bytes beyond data.corpus_bytes "
                    f"= {config.data.corpus_bytes} to validate on; use 0 (no evaluation) or lower data.corpus_bytes"
                )
            }
        )


class WindowSampler:
    """Draws a step's global batch of random windows of seq_len + 1 tokens, micro_batch × accumulation_steps
    for each data-parallel rank; validation reads consecutive windows of held-out text."""

    def __init__(
        self,
        tokens: torch.Tensor,
        seq_len: int,
        micro_batch: int,
        seed: int,
        accumulation_steps: int = 1,
        validation: torch.Tensor | None = None,
    ):
        if tokens.numel() < seq_len + 1:
            raise ValueError(
                f"the corpus holds {tokens.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
                "raise data.corpus_bytes or lower model.seq_len"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.seed = seed
        self.accumulation_steps = accumulation_steps
        self.validation = validation
        self._offsets = torch.arange(seq_len + 1)

    @classmethod
    def from_config(cls, config: RunConfig) -> WindowSampler:
        tokens = load_corpus(config.data.corpus_bytes)
        validation = load_validation(config) if config.eval.interval_steps else None
        data = config.data
        return cls(tokens, config.model.seq_len, data.micro_batch, data.seed, config.accumulation_steps, validation)

    def batch(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 [micro_batch × accumulation_steps, seq_len]: this rank's contiguous slice of
        the step's global batch; targets are inputs shifted left by one."""
        generator = torch.Generator().manual_seed(batch_seed(self.seed, step))
        last_start = self.tokens.numel() - (self.seq_len + 1)
        share = self.micro_batch * self.accumulation_steps
        global_starts = torch.randint(0, last_start + 1, (share * dp_size,), generator=generator)
        starts = global_starts[dp_rank * share : (dp_rank + 1) * share]
        windows = self.tokens[starts[:, None] + self._offsets].long()
        return windows[:, :-1], windows[:, 1:]

    def validation_batches(self, batches: int, dp_rank: int, dp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`batches` batches of micro_batch × dp_size consecutive validation windows, this rank's micro_batch of
        each; the same every time (a text too short for them all wraps around)."""
        count = (self.validation.numel() - 1) // self.seq_len
        result = []
        for numbers in validation_sequences(batches, self.micro_batch, dp_rank, dp_size, count):
            windows = self.validation[torch.from_numpy(numbers)[:, None] * self.seq_len + self._offsets].long()
            result.append((windows[:, :-1], windows[:, 1:]))
        return result

    def position(self, next_data_step: int) -> dict:
        """Windows are a pure function of (seed, step): the step is the whole position; no dataset to name."""
        return {"dataset": None}

    def resume(self, saved: dict | None, next_data_step: int) -> None:
        """A checkpoint written on a prepared dataset is refused: the demo corpus holds other tokens."""
        saved_dataset = (saved or {}).get("dataset")
        if saved_dataset is not None:
            raise DataMismatch(
                f"the checkpoint was written training on {saved_dataset['path']}, this run trains on the demo corpus "
                "(data.dataset is null); resume with that data.dataset, or start from its weights with "
                "checkpoint.init_from"
            )
