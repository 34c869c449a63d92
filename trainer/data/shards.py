"""Writing one split of a prepared dataset as fixed-size shards (the format of trainer/data/format.py), hashed as
they are written."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np

from trainer.data.format import SPLITS, shard_name

SHARD_NAME = re.compile(rf"({'|'.join(SPLITS)})-\d{{6}}\.bin")


def is_shard(name: str) -> bool:
    return SHARD_NAME.fullmatch(name) is not None


class ShardWriter:
    """Appends a split's tokens to shards of `shard_tokens` tokens each (the last one shorter); a shard's documents
    are the end-of-text tokens in it, so a document cut by a shard boundary counts in the shard where it ends."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int, eot_id: int):
        self.directory = directory
        self.split = split
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self.eot_id = eot_id
        self.shards: list[dict] = []
        self._file = None

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while len(tokens):
            if self._file is None:
                self._open()
            taken = tokens[: self.shard_tokens - self._tokens]
            data = taken.tobytes()
            self._file.write(data)
            self._sha256.update(data)
            self._tokens += len(taken)
            self._documents += int(np.count_nonzero(taken == self.eot_id))
            tokens = tokens[len(taken) :]
            if self._tokens == self.shard_tokens:
                self._close_shard()

    def close(self) -> dict:
        """The split's entry in the manifest."""
        if self._file is not None:
            self._close_shard()
        return {
            "tokens": sum(shard["tokens"] for shard in self.shards),
            "documents": sum(shard["documents"] for shard in self.shards),
            "shards": self.shards,
        }

    def _open(self) -> None:
        self._name = shard_name(self.split, len(self.shards))
        self._file = open(self.directory / self._name, "wb")
        self._sha256 = hashlib.sha256()
        self._tokens = 0
        self._documents = 0

    def _close_shard(self) -> None:
        self._file.close()
        self._file = None
        self.shards.append(
            {
                "file": self._name,
                "tokens": self._tokens,
                "documents": self._documents,
                "sha256": self._sha256.hexdigest(),
            }
        )
