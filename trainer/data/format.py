"""A prepared token dataset on disk, and reading it back without loading it.

    <dataset>/
        manifest.json            written last: its presence means the dataset is complete
        tokenizer.json           the Hugging Face `tokenizers` file (absent for byte-level tokens)
        train-000000.bin …       flat little-endian token arrays, uint16 when the vocabulary fits, else uint32;
        validation-000000.bin …  every document is followed by the end-of-text token

The manifest (FORMAT 1):

    {"format": 1, "dtype": "uint16",
     "tokenizer": {"kind": "bytes" | "trained" | "file", "file": "tokenizer.json" | null, "sha256": …,
                   "vocab_size": N, "eot_id": id, "eot_token": "<|endoftext|>"},
     "splits": {"train": {"tokens": …, "documents": …, "shards": [{"file": …, "tokens": …, "documents": …,
                                                                   "sha256": …}]},
                "validation": {…}},
     "validation_fraction": 0.01,
     "sources": [{"path": …, "bytes": …, "sha256": …}], "text_field": "text" | null, "created_at": …}

Shards are memory-mapped: opening a dataset of any size costs a few file handles, not its size in RAM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "validation")
BYTE_VOCAB_WITH_EOT = 257
"""Byte-level tokens: the 256 byte values and one end-of-text token (id 256)."""


class DatasetError(Exception):
    """A directory that is not a complete prepared dataset, or one that cannot serve what was asked."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every token id fits in it, else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:06d}.bin"


@dataclass(frozen=True)
class PreparedDataset:
    path: Path
    manifest: dict[str, Any]

    @classmethod
    def open(cls, path: str | Path) -> PreparedDataset:
        directory = Path(path)
        manifest_path = directory / MANIFEST
        if not manifest_path.is_file():
            raise DatasetError(
                f"{directory}: no {MANIFEST}, so not a complete prepared dataset; "
                "run `python -m trainer.data prepare` (again, to finish an interrupted one)"
            )
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as error:
            raise DatasetError(f"{manifest_path}: not valid JSON ({error})") from None
        if manifest.get("format") != FORMAT:
            raise DatasetError(f"{manifest_path}: format {manifest.get('format')!r}, this trainer reads {FORMAT}")
        return cls(directory, manifest)

    @property
    def vocab_size(self) -> int:
        return self.manifest["tokenizer"]["vocab_size"]

    @property
    def eot_id(self) -> int:
        return self.manifest["tokenizer"]["eot_id"]

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.manifest["dtype"]).newbyteorder("<")

    def tokens(self, split: str) -> int:
        return self.manifest["splits"][split]["tokens"]

    def shards(self, split: str) -> list[np.memmap]:
        """The split's shards in order, memory-mapped read-only (empty shards left out)."""
        if split not in SPLITS:
            raise DatasetError(f"no split {split!r}; a prepared dataset has {', '.join(SPLITS)}")
        return [
            np.memmap(self.path / shard["file"], dtype=self.dtype, mode="r", shape=(shard["tokens"],))
            for shard in self.manifest["splits"][split]["shards"]
            if shard["tokens"] > 0
        ]

    @cached_property
    def _tokenizer(self):
        if self.manifest["tokenizer"]["kind"] == "bytes":
            return None
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.path / self.manifest["tokenizer"]["file"]))

    def decode(self, ids: list[int]) -> str:
        """Text of a token sequence; the end-of-text token shows as the tokenizer's own spelling of it."""
        if self._tokenizer is not None:
            return self._tokenizer.decode(list(ids), skip_special_tokens=False)
        eot = self.manifest["tokenizer"].get("eot_token", "<|endoftext|>")
        pieces, run = [], bytearray()
        for token in ids:
            if token == self.eot_id:
                pieces += [run.decode("utf-8", "replace"), eot]
                run = bytearray()
            else:
                run.append(token)
        pieces.append(run.decode("utf-8", "replace"))
        return "".join(pieces)
