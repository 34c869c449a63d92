"""Writing small prepared token datasets for tests, straight in the documented format (trainer/data/format.py)
with numpy: byte-level tokens, every document followed by the end-of-text token."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from trainer.data.demo import stdlib_sources
from trainer.data.format import BYTE_VOCAB_WITH_EOT, FORMAT, MANIFEST, shard_name, token_dtype

BYTE_EOT = BYTE_VOCAB_WITH_EOT - 1


def write_token_dataset(
    directory: Path,
    splits: dict[str, list[np.ndarray]],
    shard_tokens: int,
    vocab_size: int = BYTE_VOCAB_WITH_EOT,
    eot_id: int = BYTE_EOT,
) -> Path:
    """A dataset of these documents per split ("train", "validation"), cut into shards of at most shard_tokens
    tokens (a document may span two shards, as the stream does); the manifest is written last."""
    directory.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    described = {}
    for split, documents in splits.items():
        stream = np.concatenate([np.append(document, eot_id) for document in documents] or [[]]).astype(dtype)
        shards = []
        for index, start in enumerate(range(0, len(stream), shard_tokens)):
            tokens = stream[start : start + shard_tokens]
            path = directory / shard_name(split, index)
            path.write_bytes(tokens.tobytes())
            shards.append(
                {
                    "file": path.name,
                    "tokens": int(len(tokens)),
                    "documents": int(np.count_nonzero(tokens == eot_id)),
                    "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                }
            )
        described[split] = {"tokens": int(len(stream)), "documents": len(documents), "shards": shards}
    manifest = {
        "format": FORMAT,
        "dtype": dtype.name,
        "tokenizer": {
            "kind": "bytes",
            "file": None,
            "sha256": None,
            "vocab_size": vocab_size,
            "eot_id": eot_id,
            "eot_token": "<|endoftext|>",
        },
        "splits": described,
        "validation_fraction": 0.1,
        "sources": [],
        "text_field": None,
        "created_at": "2026-01-01T00:00:00+00:00",
    }
    (directory / MANIFEST).write_text(json.dumps(manifest))
    return directory


def stdlib_documents(total_bytes: int, skip_files: int = 0) -> list[np.ndarray]:
    """Standard-library sources as byte documents, one per file, until total_bytes are taken."""
    documents, taken = [], 0
    for path in stdlib_sources()[skip_files:]:
        if taken >= total_bytes:
            break
        data = np.frombuffer(path.read_bytes()[: total_bytes - taken], dtype=np.uint8)
        if len(data):
            documents.append(data)
            taken += len(data)
    return documents


def stdlib_token_dataset(directory: Path, train_bytes: int, validation_bytes: int, shard_tokens: int) -> Path:
    """A byte-level dataset of standard-library sources: the train split first, the validation split from
    the files after it."""
    train = stdlib_documents(train_bytes)
    validation = stdlib_documents(validation_bytes, skip_files=len(train))
    return write_token_dataset(directory, {"train": train, "validation": validation}, shard_tokens)
