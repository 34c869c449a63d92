"""Activation checkpointing: trade recomputation in backward for activation memory."""

from __future__ import annotations

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from trainer.config import ComputeConfig
from trainer.model import Transformer


def apply_recompute(model: Transformer, compute: ComputeConfig) -> None:
    """full: keep only each block's input, recompute the block in backward. selective: recompute
    only attention (its activations grow with the sequence; the MLP's are cheap to keep), its norm outside: in a
    parallel block (model.parallel_blocks) that norm's output is the MLP's input too, kept either way. With
    recompute_every N > 1 only blocks 0, N, 2N, … do; the others keep everything.
    The wrapper strips its own prefix from state-dict keys, so checkpoints keep their names."""
    for name, block in list(model.blocks.items()):
        if not compute.recomputes_block(int(name)):
            continue
        if compute.recompute == "full":
            model.blocks[name] = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            block.attention = checkpoint_wrapper(block.attention, preserve_rng_state=False)
