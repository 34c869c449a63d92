import sysconfig
from pathlib import Path

import pytest
import torch

from trainer.data.demo import WindowSampler, load_corpus, stdlib_sources
from trainer.data.order import data_step


def sampler(seed: int = 0, micro_batch: int = 4) -> WindowSampler:
    return WindowSampler(load_corpus(50_000), seq_len=32, micro_batch=micro_batch, seed=seed)


def test_the_corpus_is_the_standard_library_in_path_order_without_site_packages():
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = stdlib_sources()
    relative = [path.relative_to(root).as_posix() for path in sources]
    assert relative == sorted(relative)
    assert "os.py" in relative
    assert not any("site-packages" in path for path in relative)
    corpus = load_corpus(20_000)
    assert corpus.dtype == torch.uint8 and corpus.numel() == 20_000
    assert bytes(corpus[:100].tolist()) == sources[0].read_bytes()[:100]


def test_the_same_seed_step_and_rank_give_the_same_batch():
    first, second = sampler(), sampler()
    for a, b in zip(first.batch(step=7, dp_rank=1, dp_size=2), second.batch(step=7, dp_rank=1, dp_size=2), strict=True):
        assert torch.equal(a, b)


def test_ranks_steps_and_seeds_each_get_different_batches():
    inputs = sampler().batch(step=3, dp_rank=0, dp_size=2)[0]
    assert not torch.equal(inputs, sampler().batch(step=3, dp_rank=1, dp_size=2)[0])
    assert not torch.equal(inputs, sampler().batch(step=4, dp_rank=0, dp_size=2)[0])
    assert not torch.equal(inputs, sampler(seed=1).batch(step=3, dp_rank=0, dp_size=2)[0])


def test_targets_are_the_inputs_shifted_by_one_token_of_a_corpus_window():
    corpus = bytes(load_corpus(50_000).tolist())
    inputs, targets = sampler().batch(step=0, dp_rank=0, dp_size=2)
    assert inputs.shape == targets.shape == (4, 32)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    for first, rest in zip(inputs[:, 0].tolist(), targets.tolist(), strict=True):
        assert bytes([first, *rest]) in corpus


def test_a_corpus_shorter_than_one_window_is_refused():
    with pytest.raises(ValueError, match="data.corpus_bytes"):
        WindowSampler(torch.zeros(32, dtype=torch.uint8), seq_len=32, micro_batch=1, seed=0)


def test_data_parallel_ranks_take_slices_of_the_one_global_batch():
    whole = sampler(micro_batch=6).batch(step=5)[0]
    slices = [sampler(micro_batch=2).batch(step=5, dp_rank=r, dp_size=3)[0] for r in range(3)]
    assert torch.equal(torch.cat(slices), whole)


def test_skipped_steps_move_every_later_step_to_the_batch_after_the_range():
    assert [data_step(step, [(5, 7)]) for step in range(3, 9)] == [3, 4, 8, 9, 10, 11]
    assert [data_step(step, [(5, 7), (10, 10)]) for step in (4, 5, 6, 7)] == [4, 8, 9, 11]
    assert data_step(12, []) == 12
