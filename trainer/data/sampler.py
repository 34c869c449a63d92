"""Reading a prepared token dataset (format.py) for training and validation.

The train split is cut into sequences: in each shard, windows of seq_len + 1 tokens at offsets k·seq_len
(inputs and targets, shifted by one, share the window), numbered across shards. Documents in the shards are
already followed by the end-of-text token, so a window packs across document boundaries.

Training reads an endless stream: epoch e is a seeded permutation of every sequence number, and step s takes
the stream's positions [(s-1)·G, s·G) for a global batch of G sequences (the stream index p is sequence
permute_e(p mod N) of epoch e = p // N). The permutation is a keyed Feistel network with cycle-walking,
evaluated per index, so nothing of the dataset's size is ever built: a step costs the same at 10 MB as at
100 GB. Data-parallel rank r of n reads only its contiguous G/n of the step's positions, so every layout
trains on the same global batch.

Validation reads the validation split's sequences in order, the same ones every time.

A checkpoint records the dataset (path, train tokens, a fingerprint of its train shards and tokenizer) and the
stream's position (epoch, sequence_offset). Resuming continues from that position, even under another global
batch; resuming on other training data is refused, naming both datasets: a run that means to switch data starts
from the checkpoint's weights (checkpoint.init_from) instead.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import torch

from trainer.config import DATASET_REFERENCE_PREFIX, ConfigError, RunConfig
from trainer.data.format import DatasetError, PreparedDataset
from trainer.data.order import DataMismatch, batch_seed, validation_sequences

FEISTEL_ROUNDS = 4
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)


def _mix(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: every input bit reaches every output bit (uint64 arithmetic wraps)."""
    values = (values ^ (values >> np.uint64(30))) * _MIX_1
    values = (values ^ (values >> np.uint64(27))) * _MIX_2
    return values ^ (values >> np.uint64(31))


class Permutation:
    """A seeded bijection of range(size), computed per index: a Feistel network on the fewest bits that hold
    size (halves of bits and bits - bits // 2, which swap places every round), walked again from any value that
    lands at or beyond size (a bijection of the larger range cycles back into range(size)). That range is less
    than twice size, so an index costs under two evaluations on average, whatever the size."""

    def __init__(self, size: int, key: int):
        if size < 1:
            raise ValueError(f"a permutation needs at least one element, not {size}")
        self.size = size
        bits = max(2, (size - 1).bit_length())
        # (high bits, low bits) of a value entering each round; an even number of rounds ends as it began.
        self._halves = [(bits - bits // 2, bits // 2), (bits // 2, bits - bits // 2)]
        self._round_keys = [np.uint64(batch_seed(key, round_)) for round_ in range(FEISTEL_ROUNDS)]
        # How many Feistel evaluations this permutation has run: the work a step costs.
        self.evaluations = 0

    def _feistel(self, values: np.ndarray) -> np.ndarray:
        self.evaluations += values.size
        for round_, round_key in enumerate(self._round_keys):
            high_bits, low_bits = self._halves[round_ % 2]
            high, low = values >> np.uint64(low_bits), values & np.uint64((1 << low_bits) - 1)
            mixed = high ^ (_mix(low ^ round_key) & np.uint64((1 << high_bits) - 1))
            # The low half moves up, the mixed high half down: next round splits the other way.
            values = (low << np.uint64(high_bits)) | mixed
        return values

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        """permute(i) for each index in range(size), as int64."""
        values = self._feistel(np.asarray(indices, dtype=np.uint64))
        outside = values >= np.uint64(self.size)
        while outside.any():
            values[outside] = self._feistel(values[outside])
            outside = values >= np.uint64(self.size)
        return values.astype(np.int64)


class SplitSequences:
    """One split's sequences: windows of seq_len + 1 tokens at k·seq_len in each shard, numbered across shards."""

    def __init__(self, dataset: PreparedDataset, split: str, seq_len: int):
        self.shards = dataset.shards(split)
        self.seq_len = seq_len
        per_shard = [max(0, (len(shard) - 1) // seq_len) for shard in self.shards]
        # Sequence numbers where each shard begins; one entry per shard, never per sequence.
        self.first_of_shard = np.cumsum([0, *per_shard])
        self.count = int(self.first_of_shard[-1])

    def windows(self, numbers: np.ndarray) -> torch.Tensor:
        """The windows of these sequence numbers, int64 [len(numbers), seq_len + 1]; only they are read."""
        shard_of = np.searchsorted(self.first_of_shard, numbers, side="right") - 1
        rows = np.empty((len(numbers), self.seq_len + 1), dtype=np.int64)
        for row, (number, shard) in enumerate(zip(numbers.tolist(), shard_of.tolist(), strict=True)):
            start = (number - int(self.first_of_shard[shard])) * self.seq_len
            rows[row] = self.shards[shard][start : start + self.seq_len + 1]
        return torch.from_numpy(rows)


def fingerprint(dataset: PreparedDataset) -> str:
    """What identifies a dataset's training tokens wherever its directory lies: its train shards' checksums, its
    token type and its tokenizer."""
    identity = {
        "dtype": dataset.manifest["dtype"],
        "tokenizer": dataset.manifest["tokenizer"].get("sha256"),
        "vocab_size": dataset.vocab_size,
        "train": [shard.get("sha256") for shard in dataset.manifest["splits"]["train"]["shards"]],
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


class TokenSampler:
    """A step's global batch from a prepared dataset, each data-parallel rank reading only its slice."""

    def __init__(self, dataset: PreparedDataset, config: RunConfig):
        self.dataset = dataset
        self.seq_len = config.model.seq_len
        self.global_batch = config.global_batch
        self.micro_batch = config.data.micro_batch
        self.seed = config.data.seed
        self.train = SplitSequences(dataset, "train", self.seq_len)
        if self.train.count == 0:
            raise DatasetError(f"{dataset.path}: the train split holds no window of seq_len + 1 = {self.seq_len + 1}")
        self._validation: SplitSequences | None = None
        self._epochs: dict[int, Permutation] = {}
        # Stream positions to add to the step's own: nonzero only after resuming with another global batch.
        self._stream_shift = 0

    def permutation(self, epoch: int) -> Permutation:
        if epoch not in self._epochs:
            # An epoch's permutation is a pure function of (seed, epoch); a run holds at most the two a step spans.
            self._epochs = {e: p for e, p in self._epochs.items() if e >= epoch - 1}
            self._epochs[epoch] = Permutation(self.train.count, batch_seed(self.seed, -1 - epoch))
        return self._epochs[epoch]

    def stream_start(self, data_step: int) -> int:
        """The stream position where the global batch of this data step begins."""
        return (data_step - 1) * self.global_batch + self._stream_shift

    def sequence_numbers(self, positions: np.ndarray) -> np.ndarray:
        """The train sequences at these stream positions."""
        epochs, offsets = np.divmod(positions, self.train.count)
        numbers = np.empty_like(positions)
        for epoch in np.unique(epochs).tolist():
            in_epoch = epochs == epoch
            numbers[in_epoch] = self.permutation(epoch)(offsets[in_epoch])
        return numbers

    def batch(self, data_step: int, dp_rank: int = 0, dp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the data step's global batch: (inputs, targets), int64 [G / dp_size, seq_len]."""
        share = self.global_batch // dp_size
        first = self.stream_start(data_step) + dp_rank * share
        windows = self.train.windows(self.sequence_numbers(np.arange(first, first + share, dtype=np.int64)))
        return windows[:, :-1], windows[:, 1:]

    def validation_batches(self, batches: int, dp_rank: int, dp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """eval.batches batches of this rank's micro_batch sequences, from the validation split in order (wrapping
        around a short split), each batch micro_batch × dp_size sequences over the ranks."""
        if self._validation is None:
            self._validation = SplitSequences(self.dataset, "validation", self.seq_len)
        result = []
        for numbers in validation_sequences(batches, self.micro_batch, dp_rank, dp_size, self._validation.count):
            windows = self._validation.windows(numbers)
            result.append((windows[:, :-1], windows[:, 1:]))
        return result

    def identity(self) -> dict[str, Any]:
        return {
            "path": str(self.dataset.path.absolute()),
            "train_tokens": self.dataset.tokens("train"),
            "fingerprint": fingerprint(self.dataset),
        }

    def position(self, next_data_step: int) -> dict[str, Any]:
        """Where the stream stands before the batch of next_data_step: the checkpoint manifest's data position."""
        epoch, offset = divmod(self.stream_start(next_data_step), self.train.count)
        return {"dataset": self.identity(), "epoch": epoch, "sequence_offset": offset}

    def resume(self, saved: dict[str, Any] | None, next_data_step: int) -> None:
        """Continue the stream where a checkpoint left it. One written on other training data is refused, naming
        both: a run changes datasets by starting from the weights (checkpoint.init_from), not by resuming."""
        saved_dataset = (saved or {}).get("dataset")
        mine = self.identity()
        if saved_dataset is None or saved_dataset.get("fingerprint") != mine["fingerprint"]:
            written_on = saved_dataset["path"] if saved_dataset else "the demo corpus"
            raise DataMismatch(
                f"the checkpoint was written training on {written_on}, this run's data.dataset is {mine['path']} "
                "(other tokens); resume with the dataset it was written on, or start from its weights with "
                "checkpoint.init_from"
            )
        saved_start = saved["epoch"] * self.train.count + saved["sequence_offset"]
        self._stream_shift = saved_start - (next_data_step - 1) * self.global_batch


def open_dataset(config: RunConfig) -> PreparedDataset:
    """The prepared dataset config.data.dataset names, checked against the config: ConfigError names the field."""
    name = config.data.dataset
    if name.startswith(DATASET_REFERENCE_PREFIX):
        raise ConfigError(
            {
                "data.dataset": (
                    f"{name!r} names a registered dataset, which the platform resolves to its directory; the trainer "
                    "run on its own takes the directory `python -m trainer.data prepare` wrote"
                )
            }
        )
    try:
        dataset = PreparedDataset.open(name)
    except DatasetError as error:
        raise ConfigError({"data.dataset": str(error)}) from None
    errors = {}
    if config.model.vocab < dataset.vocab_size:
        errors["model.vocab"] = (
            f"must be at least the dataset's tokenizer's vocabulary size {dataset.vocab_size} "
            f"(token ids go up to {dataset.vocab_size - 1}); use {dataset.vocab_size} or more"
        )
    window = config.model.seq_len + 1
    if _longest_shard(dataset, "train") < window:
        errors["model.seq_len"] = (
            f"no train shard of {name} holds a window of seq_len + 1 = {window} tokens; lower model.seq_len"
        )
    if config.eval.interval_steps and _longest_shard(dataset, "validation") < window:
        errors["eval.interval_steps"] = (
            f"the validation split of {name} holds no sequence of seq_len + 1 = {window} tokens to evaluate; "
            "use 0 (no evaluation), or prepare the dataset with a larger validation fraction"
        )
    if errors:
        raise ConfigError(errors)
    return dataset


def _longest_shard(dataset: PreparedDataset, split: str) -> int:
    return max((shard["tokens"] for shard in dataset.manifest["splits"][split]["shards"]), default=0)
