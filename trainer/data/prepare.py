"""`prepare`: text in, token shards out (the format of trainer/data/format.py).

Sources are read as a stream of chunks of about a megabyte; a pool of processes tokenizes them and writes each
chunk's tokens, per split, to DIR/.work/<key>.npz by an atomic rename. A chunk's key is a hash of its content, where
it sits in its source and everything that decides its tokens, so a run that was interrupted and is run again finds
its finished chunks and redoes only the rest (and a source changed meanwhile gets new keys). The last stage
concatenates the chunks in order into fixed-size shards, writes manifest.json last and removes .work: the result
is byte for byte what an uninterrupted run writes. Nothing holds more than a chunk per process in memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from tqdm import tqdm

from trainer.data.format import FORMAT, MANIFEST, SPLITS, TOKENIZER_FILE
from trainer.data.shards import ShardWriter, is_shard
from trainer.data.sources import Chunk, PrepareError, Source, SourceReader, find_sources
from trainer.data.tokenizing import (
    MAX_VOCAB,
    MIN_TRAINED_VOCAB,
    DocumentEncoder,
    TokenizerChoice,
    byte_level,
    train_bpe,
)
from trainer.data.tokenizing import from_file as tokenizer_from_file

log = logging.getLogger(__name__)

WORK_DIR = ".work"
DEFAULT_SHARD_TOKENS = 100_000_000
PIPELINE_VERSION = 1
"""Part of every chunk's key: raise it when a change here changes the tokens a chunk gets."""
MAX_VALIDATION_FRACTION = 0.5


def prepare(
    inputs: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    byte_level_tokens: bool = False,
    eot_token: str | None = None,
    text_field: str = "text",
    validation_fraction: float = 0.01,
    workers: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress: bool = True,
) -> dict:
    """Tokenize `inputs` into a prepared dataset at `out` and return its manifest.

    Exactly one of `tokenizer` (a tokenizer.json), `vocab_size` (train a byte-level BPE of that size on the inputs)
    or `byte_level_tokens`. Bad input raises PrepareError (its `field` names the argument) and leaves no dataset
    behind; running it again after an interruption finishes the job. `workers`: processes (None: every CPU)."""
    workers = _check_arguments(tokenizer, vocab_size, byte_level_tokens, eot_token, validation_fraction, workers)
    _check_count("shard_tokens", shard_tokens, 1)
    sources = find_sources(inputs, text_field)
    out = Path(out)
    _check_out(out)
    choice = tokenizer_from_file(tokenizer, eot_token) if tokenizer is not None else None
    if byte_level_tokens:
        choice = byte_level()
    created = not out.exists()
    work = out / WORK_DIR
    work.mkdir(parents=True, exist_ok=True)
    try:
        if choice is None:
            choice = _trained_tokenizer(sources, text_field, vocab_size, work, progress)
        run = _Tokenization(sources, text_field, choice, work, validation_fraction)
        chunk_files, records, documents = run.tokenize_all(workers, progress)
        _check_split(documents, validation_fraction)
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    structured = any(source.structured for source in sources)
    return _finish(
        out, chunk_files, choice, records, text_field if structured else None, validation_fraction, shard_tokens
    )


def _check_arguments(tokenizer, vocab_size, byte_level_tokens, eot_token, validation_fraction, workers) -> int:
    chosen = [tokenizer is not None, vocab_size is not None, bool(byte_level_tokens)]
    if sum(chosen) != 1:
        raise PrepareError(
            "tokenizer",
            "choose one way to tokenize: a tokenizer file, a vocabulary size to train a BPE on the corpus, "
            "or byte-level tokens",
        )
    if vocab_size is not None:
        _check_count("vocab_size", vocab_size, MIN_TRAINED_VOCAB, MAX_VOCAB)
    if eot_token is not None and tokenizer is None:
        raise PrepareError("eot_token", "names the end-of-text token of a tokenizer file; give one with it or drop it")
    if isinstance(validation_fraction, bool) or not isinstance(validation_fraction, int | float):
        raise PrepareError("validation_fraction", f"must be a number, not {validation_fraction!r}")
    if not 0 <= validation_fraction <= MAX_VALIDATION_FRACTION:
        raise PrepareError(
            "validation_fraction", f"must be between 0 and {MAX_VALIDATION_FRACTION}, not {validation_fraction}"
        )
    if workers is None:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _check_count("workers", workers, 1, 1024)
    return workers


def _check_count(field: str, value, least: int, most: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PrepareError(field, f"must be a whole number, not {value!r}")
    if value < least or (most is not None and value > most):
        bounds = f"at least {least}" if most is None else f"between {least} and {most}"
        raise PrepareError(field, f"must be {bounds}, not {value}")


def _check_out(out: Path) -> None:
    """`out` is new, empty, or what an interrupted prepare left: never a dataset or someone else's files."""
    if out.exists() and not out.is_dir():
        raise PrepareError("out", f"{out} is a file; give a directory for the dataset")
    if (out / MANIFEST).exists():
        raise PrepareError("out", f"{out} already holds a prepared dataset; give a new directory (or delete it)")
    if out.is_dir():
        foreign = sorted(path.name for path in out.iterdir() if not _written_by_prepare(path.name))
        if foreign:
            raise PrepareError(
                "out",
                f"{out} holds files prepare did not write ({', '.join(foreign[:5])}); give a new or empty directory",
            )


def _written_by_prepare(name: str) -> bool:
    return name in (WORK_DIR, TOKENIZER_FILE) or is_shard(name)


def _trained_tokenizer(
    sources: list[Source], text_field: str, vocab_size: int, work: Path, progress: bool
) -> TokenizerChoice:
    """Trains on a first pass over the sources; kept in .work, so an interrupted run trains it once. It is keyed
    by the sources' sizes and modification times: a source changed since makes it train again."""
    key = _digest(
        [vocab_size, text_field, *[(s.name, s.path.stat().st_size, s.path.stat().st_mtime_ns) for s in sources]]
    )
    saved = work / f"tokenizer-{key}.json"
    if saved.is_file():
        return replace(tokenizer_from_file(saved), kind="trained")
    bar = _progress_bar(sources, "training tokenizer", progress)

    def texts() -> Iterator[str]:
        for source in sources:
            for chunk in SourceReader(source, text_field).chunks():
                yield from chunk.documents
                bar.update(chunk.source_bytes)

    with bar:
        choice = train_bpe(texts(), vocab_size)
    _write_atomically(saved, choice.text.encode())
    return choice


@dataclass(frozen=True)
class _ChunkTask:
    work: Path
    fingerprint: str
    source_name: str
    chunk: Chunk
    validation_fraction: float


@dataclass(frozen=True)
class _ChunkDone:
    file: str
    source_bytes: int
    tokens: int
    reused: bool
    """Finished by an interrupted run; `tokens` is 0 then (this run made none)."""
    documents: tuple[int, int]
    """Documents ended in this chunk, per split (train, validation)."""


class _Tokenization:
    def __init__(self, sources: list[Source], text_field: str, choice: TokenizerChoice, work: Path, fraction: float):
        self.sources = sources
        self.text_field = text_field
        self.choice = choice
        self.work = work
        self.fraction = fraction
        self.fingerprint = _digest(
            [PIPELINE_VERSION, choice.sha256 or "bytes", choice.eot_id, choice.dtype.str, repr(fraction)]
        )

    def tasks(self, records: list[dict]) -> Iterator[_ChunkTask]:
        for source in self.sources:
            reader = SourceReader(source, self.text_field)
            for chunk in reader.chunks():
                yield _ChunkTask(self.work, self.fingerprint, source.name, chunk, self.fraction)
            records.append(reader.record)

    def tokenize_all(self, workers: int, progress: bool) -> tuple[list[str], list[dict], list[int]]:
        """(chunk files in order, the sources' manifest entries, documents per split)."""
        records: list[dict] = []
        files: list[str] = []
        documents = [0] * len(SPLITS)
        tokens, reused, started = 0, 0, time.monotonic()
        with _progress_bar(self.sources, "tokenizing", progress) as bar:
            for done in _ordered_map(_tokenize_chunk, self.tasks(records), workers, _start_worker, (self.choice,)):
                files.append(done.file)
                documents = [total + count for total, count in zip(documents, done.documents, strict=True)]
                tokens += done.tokens
                reused += done.reused
                bar.update(done.source_bytes)
                rate = tokens / max(time.monotonic() - started, 1e-9)
                bar.set_postfix_str(f"{tqdm.format_sizeof(rate)}tok/s", refresh=False)
        if reused:
            log.info("reused %d of %d chunks that an interrupted run had finished", reused, len(files))
        return files, records, documents


def _progress_bar(sources: list[Source], description: str, enabled: bool) -> tqdm:
    total = sum(source.path.stat().st_size for source in sources)
    return tqdm(total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled)


def _ordered_map(function: Callable, tasks: Iterable, workers: int, initializer: Callable, initargs: tuple):
    """function(task) for each task, results in task order, with at most two tasks per worker in flight: unlike
    Pool.imap, which reads its whole input ahead, this never holds more than a few chunks in memory."""
    if workers == 1:
        initializer(*initargs)
        yield from map(function, tasks)
        return
    from concurrent.futures import ProcessPoolExecutor

    # spawn: workers start clean, whatever threads (tokenizers' own pool included) the caller runs.
    context = get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=initializer, initargs=initargs) as pool:
        pending: deque = deque()
        for task in tasks:
            pending.append(pool.submit(function, task))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


_encoder: DocumentEncoder | None = None


def _start_worker(choice: TokenizerChoice) -> None:
    global _encoder
    # Each worker is one of the pool's processes; tokenizers' own threads would only compete with the others.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _encoder = DocumentEncoder(choice)


def _tokenize_chunk(task: _ChunkTask) -> _ChunkDone:
    chunk = task.chunk
    key = _chunk_key(task)
    path = task.work / f"{key}.npz"
    if path.is_file():
        with np.load(path) as finished:
            documents = tuple(int(count) for count in finished["documents"])
        return _ChunkDone(path.name, chunk.source_bytes, 0, True, documents)
    ids = _encoder.encode(chunk.documents)
    parts: dict[str, list[np.ndarray]] = {split: [] for split in SPLITS}
    counts = dict.fromkeys(SPLITS, 0)
    for offset, document_ids in enumerate(ids):
        split = (
            "validation"
            if in_validation(task.source_name, chunk.first_document + offset, task.validation_fraction)
            else "train"
        )
        parts[split].append(document_ids)
        if offset < len(ids) - 1 or chunk.last_complete:
            parts[split].append(_encoder.eot)
            counts[split] += 1
    arrays = {split: np.concatenate(parts[split]) if parts[split] else np.empty(0, _encoder.dtype) for split in SPLITS}
    documents = tuple(counts[split] for split in SPLITS)
    temporary = path.with_name(f"{key}.{os.getpid()}.tmp")
    with open(temporary, "wb") as file:
        np.savez(file, documents=np.array(documents, dtype=np.int64), **arrays)
    os.replace(temporary, path)
    tokens = sum(len(array) for array in arrays.values())
    return _ChunkDone(path.name, chunk.source_bytes, tokens, False, documents)


def _chunk_key(task: _ChunkTask) -> str:
    chunk = task.chunk
    hasher = hashlib.blake2b(digest_size=16)
    header = [task.fingerprint, task.source_name, chunk.index, chunk.first_document, chunk.last_complete]
    hasher.update(json.dumps(header).encode())
    for text in chunk.documents:
        data = text.encode()
        hasher.update(len(data).to_bytes(8, "little"))
        hasher.update(data)
    return hasher.hexdigest()


def in_validation(source_name: str, document: int, fraction: float) -> bool:
    """Whether document number `document` of a source goes to the validation split: a hash of the two falls
    below `fraction`. Deterministic, decided one document at a time, and the same wherever the corpus lies."""
    digest = hashlib.blake2b(f"{source_name}\x00{document}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


def _check_split(documents: list[int], fraction: float) -> None:
    train, validation = documents
    total = train + validation
    if total == 0:
        raise PrepareError("inputs", "the inputs hold no documents; give files with text in them")
    if fraction > 0 and validation == 0:
        raise PrepareError(
            "validation_fraction",
            f"none of the {total} documents fell to the validation split at {fraction}; raise it (to about "
            f"{min(MAX_VALIDATION_FRACTION, 2 / total):.2g} or more), give more documents (a .txt file is one "
            "document, a .jsonl line or a table row one each), or set 0 for no validation split",
        )
    if train == 0:
        raise PrepareError(
            "validation_fraction", f"all {total} documents fell to the validation split at {fraction}; lower it"
        )


def _finish(
    out: Path,
    chunk_files: list[str],
    choice: TokenizerChoice,
    records: list[dict],
    text_field: str | None,
    validation_fraction: float,
    shard_tokens: int,
) -> dict:
    """Concatenates the chunks into shards, then writes the tokenizer, the manifest (last) and drops .work."""
    work = out / WORK_DIR
    for stale in out.iterdir():
        if is_shard(stale.name):
            stale.unlink()
    writers = {split: ShardWriter(out, split, choice.dtype, shard_tokens, choice.eot_id) for split in SPLITS}
    for name in chunk_files:
        with np.load(work / name) as chunk:
            for split, writer in writers.items():
                writer.write(chunk[split])
    splits = {split: writer.close() for split, writer in writers.items()}
    if choice.text is not None:
        _write_atomically(out / TOKENIZER_FILE, choice.text.encode())
    manifest = {
        "format": FORMAT,
        "dtype": choice.dtype.name,
        "tokenizer": choice.manifest_entry(),
        "splits": splits,
        "validation_fraction": validation_fraction,
        "sources": records,
        "text_field": text_field,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    _write_atomically(out / MANIFEST, json.dumps(manifest, indent=2).encode())
    shutil.rmtree(work)
    return manifest


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def _digest(parts: list) -> str:
    return hashlib.blake2b(json.dumps(parts).encode(), digest_size=16).hexdigest()
