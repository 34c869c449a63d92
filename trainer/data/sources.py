"""What `prepare` reads: .txt, .jsonl and .parquet files, directories of them, and datasets written by Hugging Face
`datasets`' save_to_disk (read as Arrow streams, without importing `datasets`), as chunks of about a megabyte.

A .txt file is one document, read in pieces cut at line ends; a .jsonl line is one document (its text field); a
parquet row or a saved dataset's row is one document (its text column). Reading a source hashes it on the way.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

CHUNK_BYTES = 1 << 20
"""About how much text one chunk (prepare's unit of work, of resumption and of progress) holds."""
KINDS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
SAVED_DATASET_STATE = "state.json"
READABLE = ".txt, .jsonl and .parquet files, directories of them, and datasets written by `datasets`' save_to_disk"
# Rows pyarrow hands over at a time; a chunk gathers batches until it holds CHUNK_BYTES of text.
ROWS_PER_BATCH = 1024


class PrepareError(ValueError):
    """Input `prepare` cannot use, with the argument to change (`field`) and what would be right."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Source:
    path: Path
    name: str
    """The path relative to the input it was found under, led by that input's own name: where the corpus lies
    changes nothing, so the split (keyed by it) is the same wherever it is prepared from."""
    kind: str

    @property
    def structured(self) -> bool:
        """Documents are a text field of records (jsonl, parquet, Arrow), not whole files."""
        return self.kind != "txt"


@dataclass(frozen=True)
class Chunk:
    index: int
    first_document: int
    """The source's running number of the first document here: what the split is decided by."""
    documents: list[str]
    last_complete: bool
    """False when the last document goes on in the next chunk (a piece of a big .txt file): no end-of-text yet."""
    source_bytes: int


def find_sources(inputs: Sequence[str | os.PathLike], text_field: str) -> list[Source]:
    """Every source the inputs name, in order (a directory's files sorted by path); structured sources are checked
    to have a string column `text_field`. Hidden files and directories are skipped."""
    if not inputs:
        raise PrepareError("inputs", f"give at least one input: {READABLE}")
    sources: list[Source] = []
    for given in inputs:
        path = Path(given)
        if not path.exists():
            raise PrepareError("inputs", f"{path}: no such file or directory")
        if path.is_dir():
            found = _directory_sources(path)
            if not found:
                raise PrepareError("inputs", f"{path}: nothing to read in this directory; prepare reads {READABLE}")
            sources += found
        else:
            sources.append(Source(path, path.name, _kind_of(path)))
    for source in sources:
        if source.kind in ("parquet", "arrow"):
            _check_column(source, _schema(source), text_field)
    return sources


def _kind_of(path: Path) -> str:
    kind = KINDS.get(path.suffix.lower())
    if kind is None:
        raise PrepareError(
            "inputs", f"{path}: unknown kind of file {path.suffix or '(no extension)'!r}; prepare reads {READABLE}"
        )
    return kind


def _directory_sources(root: Path) -> list[Source]:
    prefix = root.resolve().name
    if (root / SAVED_DATASET_STATE).is_file():
        return _saved_dataset_sources(root, prefix)
    sources: list[Source] = []
    for directory, subdirectories, files in os.walk(root):
        here = Path(directory)
        relative = here.relative_to(root)
        if here != root and (here / SAVED_DATASET_STATE).is_file():
            sources += _saved_dataset_sources(here, f"{prefix}/{relative.as_posix()}")
            subdirectories[:] = []
            continue
        subdirectories[:] = [name for name in subdirectories if not name.startswith(".")]
        for name in files:
            suffix = Path(name).suffix.lower()
            if suffix in KINDS and not name.startswith("."):
                sources.append(Source(here / name, f"{prefix}/{(relative / name).as_posix()}", KINDS[suffix]))
    return sorted(sources, key=lambda source: source.name)


def _saved_dataset_sources(directory: Path, prefix: str) -> list[Source]:
    state_path = directory / SAVED_DATASET_STATE
    try:
        files = [entry["filename"] for entry in json.loads(state_path.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as error:
        raise PrepareError(
            "inputs", f"{state_path}: not the state of a dataset saved by save_to_disk ({error})"
        ) from None
    sources = []
    for filename in files:
        path = directory / filename
        if not path.is_file():
            raise PrepareError("inputs", f"{path}: listed in {state_path} but missing; save the dataset again")
        sources.append(Source(path, f"{prefix}/{filename}", "arrow"))
    return sources


def _schema(source: Source) -> pa.Schema:
    try:
        if source.kind == "parquet":
            return pq.ParquetFile(source.path).schema_arrow
        with pa.memory_map(str(source.path)) as stream:
            return pa.ipc.open_stream(stream).schema
    except (pa.ArrowException, OSError) as error:
        raise PrepareError("inputs", f"{source.path}: not a readable {source.kind} file ({error})") from None


def _check_column(source: Source, schema: pa.Schema, text_field: str) -> None:
    if text_field not in schema.names:
        raise PrepareError("text_field", f"{source.path} has no column {text_field!r}; its columns are {schema.names}")
    column_type = schema.field(text_field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise PrepareError(
            "text_field", f"{source.path}: column {text_field!r} holds {column_type}, not text; name a string column"
        )


@dataclass
class SourceReader:
    """Reads one source as chunks; once they are all read, `record` is its entry in the manifest."""

    source: Source
    text_field: str
    _sha256: hashlib._Hash = field(default_factory=hashlib.sha256)
    _bytes: int = 0

    @property
    def record(self) -> dict:
        return {"path": str(self.source.path), "bytes": self._bytes, "sha256": self._sha256.hexdigest()}

    def chunks(self) -> Iterator[Chunk]:
        if self.source.kind == "txt":
            return self._text_chunks()
        if self.source.kind == "jsonl":
            return self._jsonl_chunks()
        return self._table_chunks()

    def _read(self, file, size: int = CHUNK_BYTES) -> bytes:
        block = file.read(size)
        self._sha256.update(block)
        self._bytes += len(block)
        return block

    def _text_chunks(self) -> Iterator[Chunk]:
        # One block is read ahead, so the piece that ends the file is known to be the last and carries the
        # end-of-text: a small file is one chunk.
        index, offset, carry = 0, 0, b""
        with open(self.source.path, "rb") as file:
            block = self._read(file)
            while True:
                ahead = self._read(file) if block else b""
                data = carry + block
                cut = (data.rfind(b"\n") + 1 or _last_character_start(data)) if ahead else len(data)
                piece, carry = data[:cut], data[cut:]
                yield Chunk(index, 0, [self._decode(piece, offset)], last_complete=not ahead, source_bytes=len(piece))
                if not ahead:
                    return
                block, offset, index = ahead, offset + len(piece), index + 1

    def _decode(self, piece: bytes, offset: int) -> str:
        try:
            return piece.decode("utf-8")
        except UnicodeDecodeError as error:
            raise PrepareError(
                "inputs",
                f"{self.source.path}: not UTF-8 text at byte {offset + error.start}; convert it to UTF-8 "
                "(for example with iconv -t utf-8)",
            ) from None

    def _jsonl_chunks(self) -> Iterator[Chunk]:
        documents: list[str] = []
        index, first_document, pending_bytes = 0, 0, 0
        with open(self.source.path, "rb") as file:
            for line_number, line in enumerate(iter(lambda: file.readline(), b""), start=1):
                self._sha256.update(line)
                self._bytes += len(line)
                pending_bytes += len(line)
                if line.strip():
                    documents.append(self._text_of_line(line, line_number))
                if pending_bytes >= CHUNK_BYTES:
                    yield Chunk(index, first_document, documents, True, pending_bytes)
                    index, first_document = index + 1, first_document + len(documents)
                    documents, pending_bytes = [], 0
        if documents or pending_bytes:
            yield Chunk(index, first_document, documents, True, pending_bytes)

    def _text_of_line(self, line: bytes, line_number: int) -> str:
        where = f"{self.source.path}, line {line_number}"
        try:
            record = json.loads(line)
        except ValueError as error:
            raise PrepareError("inputs", f"{where}: not valid JSON ({error})") from None
        if not isinstance(record, dict) or self.text_field not in record:
            fields = sorted(record) if isinstance(record, dict) else f"a JSON {type(record).__name__}, not an object"
            raise PrepareError(
                "text_field", f"{where}: no field {self.text_field!r} (it has {fields}); name its text field"
            )
        text = record[self.text_field]
        if not isinstance(text, str):
            raise PrepareError(
                "text_field", f"{where}: field {self.text_field!r} is {type(text).__name__}, not a string"
            )
        return text

    def _table_chunks(self) -> Iterator[Chunk]:
        with open(self.source.path, "rb") as file:
            while self._read(file):
                pass
        documents: list[str] = []
        index, first_document, pending_chars, pending_bytes = 0, 0, 0, 0
        for texts, consumed in self._table_batches():
            row = first_document + len(documents)
            if None in texts:
                empty = row + texts.index(None)
                raise PrepareError(
                    "text_field", f"{self.source.path}, row {empty}: column {self.text_field!r} is null, not a string"
                )
            documents += texts
            pending_chars += sum(map(len, texts))
            pending_bytes += consumed
            if pending_chars >= CHUNK_BYTES:
                yield Chunk(index, first_document, documents, True, pending_bytes)
                index, first_document = index + 1, first_document + len(documents)
                documents, pending_chars, pending_bytes = [], 0, 0
        if documents:
            yield Chunk(index, first_document, documents, True, pending_bytes)

    def _table_batches(self) -> Iterator[tuple[list[str | None], int]]:
        """(texts, bytes of the file they stand for) per record batch; the bytes only drive the progress bar."""
        if self.source.kind == "parquet":
            table = pq.ParquetFile(self.source.path)
            rows, done = table.metadata.num_rows, 0
            for batch in table.iter_batches(batch_size=ROWS_PER_BATCH, columns=[self.text_field]):
                before, done = done, done + batch.num_rows
                yield batch.column(0).to_pylist(), self._bytes * done // rows - self._bytes * before // rows
            return
        with pa.memory_map(str(self.source.path)) as stream:
            reader, position = pa.ipc.open_stream(stream), 0
            for batch in reader:
                before, position = position, stream.tell()
                yield batch.column(self.text_field).to_pylist(), position - before


def _last_character_start(data: bytes) -> int:
    """Where to cut a block without a line end so that no UTF-8 character is split (before the last one)."""
    cut = len(data)
    while cut > max(0, len(data) - 4) and data[cut - 1] & 0xC0 == 0x80:
        cut -= 1
    if cut and data[cut - 1] >= 0xC0:
        cut -= 1
    return cut or len(data)
