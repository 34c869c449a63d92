"""The pure parts of the parallel plans: which stages and positions each rank holds."""

import torch

from trainer.config import ParallelConfig
from trainer.parallel.context import load_balanced_positions
from trainer.parallel.pipeline import stage_indices
from trainer.pipeline_split import splits, stage_block_counts, stage_blocks


def test_load_balanced_chunks_give_every_cp_rank_an_early_and_a_late_chunk():
    held = [load_balanced_positions(16, 4, rank) for rank in range(4)]
    assert held[0].tolist() == [0, 1, 14, 15]
    assert held[3].tolist() == [6, 7, 8, 9]
    assert sorted(torch.cat(held).tolist()) == list(range(16))
    # Causal work of a query is its position + 1: every rank gets the same total.
    assert len({int((positions + 1).sum()) for positions in held}) == 1


def test_looped_schedules_place_stages_round_robin():
    parallel = ParallelConfig(pp=2, pp_schedule="Interleaved1F1B", stages_per_rank=3, microbatches=2)
    assert stage_indices(parallel, 0) == [0, 2, 4]
    assert stage_indices(parallel, 1) == [1, 3, 5]


def test_v_schedules_put_the_first_and_last_stage_on_one_rank():
    parallel = ParallelConfig(pp=4, pp_schedule="ZBVZeroBubble", stages_per_rank=2, microbatches=4)
    assert [stage_indices(parallel, rank) for rank in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_one_stage_schedules_hold_their_own_stage():
    assert stage_indices(ParallelConfig(pp=4, pp_schedule="1F1B", microbatches=4), 2) == [2]


def test_layers_are_split_evenly_and_in_order():
    assert [list(stage_blocks(8, 4, stage)) for stage in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_recompute_wraps_blocks_or_attention_and_keeps_parameter_names():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from trainer.config import ComputeConfig, ModelConfig
    from trainer.model import Transformer
    from trainer.parallel.recompute import apply_recompute

    config = ModelConfig(layers=2, dim=32, heads=4, kv_heads=2, ffn=64, seq_len=16)
    names = set(Transformer(config).state_dict())
    full, selective = Transformer(config), Transformer(config)
    apply_recompute(full, ComputeConfig(recompute="full"))
    apply_recompute(selective, ComputeConfig(recompute="selective"))
    assert all(isinstance(block, CheckpointWrapper) for block in full.blocks.values())
    assert all(isinstance(block.attention, CheckpointWrapper) for block in selective.blocks.values())
    assert set(full.state_dict()) == names == set(selective.state_dict())
    tokens = torch.randint(0, 256, (2, 16))
    full(tokens, tokens).backward()
    assert all(parameter.grad is not None for parameter in full.parameters())
    every_other = Transformer(config.model_copy(update={"layers": 4}))
    apply_recompute(every_other, ComputeConfig(recompute="full", recompute_every=2))
    wrapped = [name for name, block in every_other.blocks.items() if isinstance(block, CheckpointWrapper)]
    assert wrapped == ["0", "2"]


def test_blocks_that_stages_do_not_divide_count_the_embedding_and_output_as_a_block_each():
    assert stage_block_counts(126, 16) == [7] + [8] * 14 + [7]
    assert stage_block_counts(126, 64) == [1] + [2] * 62 + [1]
    assert [list(stage_blocks(4, 3, stage)) for stage in range(3)] == [[0], [1, 2], [3]]
    assert stage_block_counts(8, 4) == [2, 2, 2, 2]
    # 4 blocks on 6 stages would leave the first and last with none; 5 stages divide neither 4 nor 6.
    assert not splits(4, 6) and not splits(4, 5) and splits(4, 3)
