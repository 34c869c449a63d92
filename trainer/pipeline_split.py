"""How a model's blocks split over pipeline stages.

Evenly where the stages divide the blocks. Otherwise, where they divide the blocks plus two, the embedding and
the output layer each count as one block, so the first and the last stage hold one block fewer than the others:
Megatron-LM's account-for-embedding/loss-in-pipeline-split, and how Llama 3.1 405B's 126 blocks ran on 16 stages
(7, 8, …, 8, 7).
"""

from __future__ import annotations


def evenly(layers: int, stages: int) -> bool:
    """Whether every stage holds as many blocks as the others."""
    return layers % stages == 0


def splits(layers: int, stages: int) -> bool:
    """Whether these stages can share the blocks, each holding at least one."""
    if evenly(layers, stages):
        return True
    return (layers + 2) % stages == 0 and (layers + 2) // stages >= 2


def stage_block_counts(layers: int, stages: int) -> list[int]:
    """Blocks each stage holds, in stage order (for a split that `splits` accepts)."""
    if evenly(layers, stages):
        return [layers // stages] * stages
    counts = [(layers + 2) // stages] * stages
    counts[0] -= 1
    counts[-1] -= 1
    return counts


def stage_blocks(layers: int, stages: int, stage: int) -> range:
    """The indices of the blocks one stage holds."""
    counts = stage_block_counts(layers, stages)
    start = sum(counts[:stage])
    return range(start, start + counts[stage])
