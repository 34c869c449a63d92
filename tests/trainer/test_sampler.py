"""The token-dataset sampler: a step's global batch is a pure function of (seed, step), the same in every layout,
each rank reading only its slice; its position goes into the checkpoint, so a resumed run continues exactly."""

import json
import tracemalloc

import numpy as np
import pytest
import torch

from trainer.config import ConfigError, parse_config
from trainer.data.order import DataMismatch, data_step
from trainer.data.sampler import Permutation, SplitSequences, TokenSampler, open_dataset
from trainer.train import USAGE_EXIT_CODE, main

from .token_dataset import BYTE_EOT, stdlib_token_dataset, write_token_dataset
from .torchrun import run_trainer

SEQ_LEN = 16


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """About 1,900 train sequences over three shards, and a validation split."""
    return stdlib_token_dataset(tmp_path_factory.mktemp("tokens") / "ds", 30_000, 5_000, shard_tokens=12_000)


def config(dataset, micro_batch=2, global_batch=8, data_parallel=1, **data) -> dict:
    return {
        "model": {"seq_len": SEQ_LEN, "vocab": 320},
        "parallel": {"dp_shard": data_parallel},
        "data": {"dataset": str(dataset), "micro_batch": micro_batch, "global_batch": global_batch, **data},
    }


def sampler(dataset, **kwargs) -> TokenSampler:
    run_config = parse_config(config(dataset, **kwargs))
    return TokenSampler(open_dataset(run_config), run_config)


def test_a_permutation_is_a_bijection_of_any_size():
    for size in (1, 2, 3, 7, 64, 1000, 4099):
        permuted = Permutation(size, key=5)(np.arange(size))
        assert sorted(permuted.tolist()) == list(range(size))
    assert not np.array_equal(Permutation(1000, key=5)(np.arange(1000)), np.arange(1000))
    assert not np.array_equal(Permutation(1000, key=5)(np.arange(1000)), Permutation(1000, key=6)(np.arange(1000)))


def test_a_step_costs_the_same_work_whatever_the_dataset_size():
    # A dataset of 10^15 sequences: building anything of its size would exhaust memory long before the end.
    small, huge = Permutation(10_000, key=1), Permutation(10**15, key=1)
    indices = np.arange(10**15 - 64, 10**15, dtype=np.int64)
    tracemalloc.start()
    permuted = huge(indices)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert ((permuted >= 0) & (permuted < 10**15)).all() and len(set(permuted.tolist())) == 64
    assert peak < 100_000
    small(np.arange(64))
    # Cycle-walking costs each index fewer than four Feistel evaluations on average, at any size.
    assert huge.evaluations < 4 * 64 and small.evaluations < 4 * 64


def test_the_sampler_reads_only_the_windows_of_its_slice(dataset, monkeypatch):
    reads = []
    original = SplitSequences.windows

    def counted(self, numbers):
        reads.append(len(numbers))
        return original(self, numbers)

    monkeypatch.setattr(SplitSequences, "windows", counted)
    sampler(dataset, micro_batch=2, global_batch=16, data_parallel=4).batch(5, dp_rank=3, dp_size=4)
    assert reads == [4]


def test_the_same_seed_and_step_give_the_same_global_batch_in_every_layout(dataset):
    whole = sampler(dataset, micro_batch=8, global_batch=16).batch(7)[0]
    assert whole.shape == (16, SEQ_LEN)
    assert torch.equal(whole, sampler(dataset, micro_batch=8, global_batch=16).batch(7)[0])
    for data_parallel, micro_batch in ((2, 4), (4, 2), (4, 1)):
        slices = [
            sampler(dataset, micro_batch=micro_batch, global_batch=16, data_parallel=data_parallel).batch(
                7, dp_rank=rank, dp_size=data_parallel
            )[0]
            for rank in range(data_parallel)
        ]
        assert torch.equal(torch.cat(slices), whole), (data_parallel, micro_batch)
    assert not torch.equal(whole, sampler(dataset, micro_batch=8, global_batch=16).batch(8)[0])
    assert not torch.equal(whole, sampler(dataset, micro_batch=8, global_batch=16, seed=1).batch(7)[0])


def short_documents(count: int, seed: int = 0) -> list[np.ndarray]:
    generator = np.random.default_rng(seed)
    return [generator.integers(0, 256, generator.integers(3, 30)).astype(np.uint16) for _ in range(count)]


def test_sequences_are_shard_windows_k_seq_len_apart_packed_across_documents(tmp_path):
    directory = write_token_dataset(tmp_path / "ds", {"train": short_documents(60), "validation": []}, 250)
    source = sampler(directory, micro_batch=5, global_batch=5)
    every_window = {
        tuple(shard[start : start + SEQ_LEN + 1].tolist())
        for shard in source.train.shards
        for start in range(0, len(shard) - SEQ_LEN, SEQ_LEN)
    }
    assert len(every_window) == source.train.count
    taken = []
    for step in range(1, source.train.count // 5 + 1):
        inputs, targets = source.batch(step)
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
        taken += [tuple([row[0], *rest]) for row, rest in zip(inputs.tolist(), targets.tolist(), strict=True)]
    assert set(taken) <= every_window and len(set(taken)) == len(taken)
    assert any(BYTE_EOT in window[1:-1] for window in taken), "windows run on across a document's end"


def test_an_epoch_visits_every_sequence_once_then_the_next_epoch_wraps_in_another_order(dataset):
    source = sampler(dataset)
    count = source.train.count
    numbers = source.sequence_numbers(np.arange(2 * count, dtype=np.int64))
    first_epoch, second_epoch = numbers[:count], numbers[count:]
    assert sorted(first_epoch.tolist()) == sorted(second_epoch.tolist()) == list(range(count))
    assert not np.array_equal(first_epoch, second_epoch)
    step_into_second_epoch = count // 8 + 2
    assert source.position(step_into_second_epoch)["epoch"] == 1
    assert source.position(step_into_second_epoch)["sequence_offset"] == (step_into_second_epoch - 1) * 8 - count


def test_skipped_steps_take_the_batches_after_the_range(dataset):
    source = sampler(dataset, skip_steps=[[3, 4]])
    assert torch.equal(source.batch(data_step(3, [(3, 4)]))[0], source.batch(5)[0])


def test_validation_batches_are_the_same_sequences_every_time_and_split_over_ranks(dataset):
    whole = sampler(dataset, micro_batch=4, global_batch=4).validation_batches(3, 0, 1)
    assert len(whole) == 3 and all(inputs.shape == (4, SEQ_LEN) for inputs, _ in whole)
    halves = [
        sampler(dataset, micro_batch=2, global_batch=4, data_parallel=2).validation_batches(3, r, 2) for r in (0, 1)
    ]
    for index, (inputs, _) in enumerate(whole):
        assert torch.equal(torch.cat([halves[0][index][0], halves[1][index][0]]), inputs)


def test_resuming_on_other_training_data_is_refused_naming_both(dataset, tmp_path):
    other = stdlib_token_dataset(tmp_path / "other", 20_000, 5_000, shard_tokens=12_000)
    saved = {"next_step": 4, "seed": 0, **sampler(other).position(4)}
    with pytest.raises(DataMismatch) as refused:
        sampler(dataset).resume(saved, 4)
    assert str(other) in str(refused.value) and str(dataset) in str(refused.value)
    with pytest.raises(DataMismatch, match="demo corpus"):
        sampler(dataset).resume({"next_step": 4, "seed": 0}, 4)


def test_resuming_with_another_global_batch_continues_the_stream_where_it_stopped(dataset):
    saved = {"next_step": 4, "seed": 0, **sampler(dataset, global_batch=8).position(4)}
    resumed = sampler(dataset, global_batch=4, micro_batch=4)
    resumed.resume(saved, 4)
    continuing = sampler(dataset, global_batch=8)
    assert torch.equal(resumed.batch(4)[0], continuing.batch(4)[0][:4])
    assert torch.equal(resumed.batch(5)[0], continuing.batch(4)[0][4:])


@pytest.mark.parametrize(
    ("change", "field", "says"),
    [
        ({"data": {"dataset": "dataset:12"}}, "data.dataset", "the platform resolves"),
        ({"data": {"dataset": "/nonexistent/tokens"}}, "data.dataset", "not a complete prepared dataset"),
        ({"model": {"vocab": 256}}, "model.vocab", "vocabulary size 257"),
        ({"eval": {"interval_steps": 5}}, "eval.interval_steps", "validation split"),
    ],
)
def test_the_trainer_refuses_data_it_cannot_train_on_naming_the_field(tmp_path, capsys, change, field, says):
    documents = [np.arange(100, dtype=np.uint16)] * 5
    directory = write_token_dataset(tmp_path / "ds", {"train": documents, "validation": [documents[0][:3]]}, 200)
    document = config(directory)
    for section, values in change.items():
        document.setdefault(section, {}).update(values)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(document))
    assert main(["--config", str(path)]) == USAGE_EXIT_CODE
    assert f"{field}: " in capsys.readouterr().err
    with pytest.raises(ConfigError) as refused:
        open_dataset(parse_config(document))
    assert says in refused.value.errors[field]


def tiny_run(dataset, directory, **checkpoint) -> dict:
    return {
        "steps": 6,
        "model": {"layers": 2, "dim": 32, "heads": 2, "kv_heads": 1, "ffn": 64, "seq_len": SEQ_LEN, "vocab": 320},
        "compute": {"precision": "fp32"},
        "optimizer": {"warmup_steps": 1},
        "data": {"dataset": str(dataset), "micro_batch": 2, "global_batch": 8},
        "checkpoint": {"directory": str(directory), "async_save": False, **checkpoint},
        "telemetry": {"flush_interval_s": 0.2, "heartbeat_interval_s": 60, "comm": False},
    }


@pytest.mark.slow
def test_a_run_resumed_on_a_token_dataset_continues_with_exactly_the_uninterrupted_losses(dataset, tmp_path):
    uninterrupted = run_trainer(tmp_path / "whole", tiny_run(dataset, tmp_path / "whole-ckpt", interval_steps=3))
    assert uninterrupted.returncode == 0, uninterrupted.failure_report()
    checkpoint = tmp_path / "whole-ckpt" / "step-000003"
    position = json.loads((checkpoint / "manifest.json").read_text())["data"]
    assert position == {"next_step": 4, "seed": 0, **sampler(dataset).position(4)}
    assert position["epoch"] == 0 and position["sequence_offset"] == 3 * 8

    resumed = run_trainer(tmp_path / "resumed", tiny_run(dataset, tmp_path / "resumed-ckpt", resume=str(checkpoint)))
    assert resumed.returncode == 0, resumed.failure_report()
    assert resumed.loss_means() == uninterrupted.loss_means()[3:]
