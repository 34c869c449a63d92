"""`python -m trainer.data prepare`: text files, jsonl, parquet and saved `datasets` in; token shards out, read back
through the dataset format's own reader (trainer/data/format.py)."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from trainer.data.__main__ import main
from trainer.data.format import MANIFEST, SPLITS, PreparedDataset
from trainer.data.prepare import WORK_DIR, in_validation, prepare
from trainer.data.sources import PrepareError

ROOT = Path(__file__).resolve().parents[2]
VALIDATION_FRACTION = 0.25
# Small shards, so documents straddle shard boundaries.
SHARD_TOKENS = 1500


def write_corpus(directory: Path) -> dict[str, list[str]]:
    """One source of each kind; returns each source's documents by its name (the split's key)."""
    directory.mkdir()
    (directory / "texts").mkdir()
    stories = {
        "texts/a.txt": "Once upon a time, a loom wove tokens.\nThé end — ünïcödé ✓\n" * 20,
        "texts/b.txt": "no newline at the end",
    }
    for name, text in stories.items():
        (directory / name).write_text(text)
    lines = [f"record {i}: the quick brown fox jumps over the lazy dog" for i in range(12)]
    lines[3] = "a record that spells <|endoftext|> out in its text"
    (directory / "records.jsonl").write_text(
        "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(lines))
    )
    rows = [f"parquet row {i} {'lorem ipsum ' * (i % 5)}" for i in range(15)]
    pq.write_table(pa.table({"text": rows, "n": list(range(15))}), directory / "table.parquet")
    saved_rows = [f"saved row {i}: {'dolor sit amet ' * (i % 3)}" for i in range(10)]
    datasets.Dataset.from_dict({"text": saved_rows}).save_to_disk(str(directory / "saved"))
    prefix = directory.name
    return {
        **{f"{prefix}/{name}": [text] for name, text in stories.items()},
        f"{prefix}/records.jsonl": lines,
        f"{prefix}/saved/data-00000-of-00001.arrow": saved_rows,
        f"{prefix}/table.parquet": rows,
    }


def expected_splits(documents: dict[str, list[str]], fraction: float) -> dict[str, list[str]]:
    """The documents of each split in the order prepare writes them: sources sorted by path, documents in order."""
    splits = {split: [] for split in SPLITS}
    for name in sorted(documents):
        for index, text in enumerate(documents[name]):
            splits["validation" if in_validation(name, index, fraction) else "train"].append(text)
    return splits


def decoded_documents(dataset: PreparedDataset, split: str) -> list[str]:
    shards = dataset.shards(split)
    tokens = np.concatenate(shards) if shards else np.empty(0, dataset.dtype)
    ends = np.flatnonzero(tokens == dataset.eot_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [dataset.decode(tokens[start:end].tolist()) for start, end in zip(starts, ends, strict=True)]


def assert_shards_match_manifest(dataset: PreparedDataset) -> None:
    for split in SPLITS:
        entry = dataset.manifest["splits"][split]
        assert entry["tokens"] == sum(shard["tokens"] for shard in entry["shards"])
        for shard in entry["shards"]:
            data = (dataset.path / shard["file"]).read_bytes()
            assert len(data) == shard["tokens"] * dataset.dtype.itemsize
            assert hashlib.sha256(data).hexdigest() == shard["sha256"]
            tokens = np.frombuffer(data, dtype=dataset.dtype)
            assert shard["documents"] == np.count_nonzero(tokens == dataset.eot_id)
        assert entry["documents"] == sum(shard["documents"] for shard in entry["shards"])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, dict[str, list[str]]]:
    directory = tmp_path_factory.mktemp("inputs") / "corpus"
    return directory, write_corpus(directory)


@pytest.fixture(scope="module")
def byte_dataset(corpus, tmp_path_factory) -> PreparedDataset:
    out = tmp_path_factory.mktemp("bytes") / "dataset"
    prepare(
        [corpus[0]],
        out,
        byte_level_tokens=True,
        validation_fraction=VALIDATION_FRACTION,
        shard_tokens=SHARD_TOKENS,
        workers=1,
        progress=False,
    )
    return PreparedDataset.open(out)


@pytest.fixture(scope="module")
def trained_dataset(corpus, tmp_path_factory) -> PreparedDataset:
    out = tmp_path_factory.mktemp("trained") / "dataset"
    prepare(
        [corpus[0]],
        out,
        vocab_size=300,
        validation_fraction=VALIDATION_FRACTION,
        shard_tokens=SHARD_TOKENS,
        workers=2,
        progress=False,
    )
    return PreparedDataset.open(out)


def test_text_jsonl_parquet_and_a_saved_dataset_become_byte_tokens_that_decode_to_their_text(corpus, byte_dataset):
    directory, documents = corpus
    manifest = byte_dataset.manifest
    assert manifest["tokenizer"] == {
        "kind": "bytes",
        "file": None,
        "sha256": None,
        "vocab_size": 257,
        "eot_id": 256,
        "eot_token": "<|endoftext|>",
    }
    assert manifest["dtype"] == "uint16" and manifest["text_field"] == "text"
    assert not (byte_dataset.path / "tokenizer.json").exists() and not (byte_dataset.path / WORK_DIR).exists()
    assert_shards_match_manifest(byte_dataset)
    assert len(manifest["splits"]["train"]["shards"]) > 1
    expected = expected_splits(documents, VALIDATION_FRACTION)
    assert expected["validation"] and expected["train"]
    for split in SPLITS:
        assert decoded_documents(byte_dataset, split) == expected[split]
        assert manifest["splits"][split]["tokens"] == sum(len(text.encode()) + 1 for text in expected[split])
    files = sorted(path for path in directory.rglob("*") if path.suffix in (".txt", ".jsonl", ".parquet", ".arrow"))
    assert [Path(source["path"]) for source in manifest["sources"]] == files
    for source in manifest["sources"]:
        data = Path(source["path"]).read_bytes()
        assert source["bytes"] == len(data) and source["sha256"] == hashlib.sha256(data).hexdigest()


def test_a_bpe_trained_on_the_corpus_has_the_chosen_size_and_round_trips_every_document(corpus, trained_dataset):
    _, documents = corpus
    tokenizer = trained_dataset.manifest["tokenizer"]
    file = trained_dataset.path / "tokenizer.json"
    assert tokenizer["kind"] == "trained" and tokenizer["vocab_size"] == 300
    assert tokenizer["sha256"] == hashlib.sha256(file.read_bytes()).hexdigest()
    assert Tokenizer.from_file(str(file)).token_to_id("<|endoftext|>") == tokenizer["eot_id"]
    assert_shards_match_manifest(trained_dataset)
    expected = expected_splits(documents, VALIDATION_FRACTION)
    for split in SPLITS:
        # The record that spells "<|endoftext|>" out stays one document: only prepare's own end-of-text ends one.
        assert decoded_documents(trained_dataset, split) == expected[split]
    byte_count = sum(len(text.encode()) for split in SPLITS for text in expected[split])
    assert trained_dataset.tokens("train") + trained_dataset.tokens("validation") < byte_count


def test_a_given_tokenizer_file_is_copied_and_tokenizes_as_it_did_when_trained(corpus, trained_dataset, tmp_path):
    given = tmp_path / "given.json"
    given.write_bytes((trained_dataset.path / "tokenizer.json").read_bytes())
    out = tmp_path / "dataset"
    manifest = prepare(
        [corpus[0]],
        out,
        tokenizer=given,
        validation_fraction=VALIDATION_FRACTION,
        shard_tokens=SHARD_TOKENS,
        workers=1,
        progress=False,
    )
    assert manifest["tokenizer"] == {**trained_dataset.manifest["tokenizer"], "kind": "file"}
    assert (out / "tokenizer.json").read_bytes() == given.read_bytes()
    for split in SPLITS:
        for shard in trained_dataset.manifest["splits"][split]["shards"]:
            assert (out / shard["file"]).read_bytes() == (trained_dataset.path / shard["file"]).read_bytes()


def word_level_tokenizer(path: Path, words: int, specials: list[str]) -> Path:
    vocab = {f"w{i}": i for i in range(words)} | {token: words + i for i, token in enumerate(specials)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=specials[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def test_a_vocabulary_over_65536_tokens_is_stored_as_uint32(tmp_path):
    tokenizer = word_level_tokenizer(tmp_path / "words.json", 70_000, ["[UNK]", "</s>"])
    corpus = tmp_path / "words.jsonl"
    texts = ["w69999 w1 w65536", "w0 w70000", "w5"]
    corpus.write_text("".join(json.dumps({"body": text}) + "\n" for text in texts))
    prepare(
        [corpus], tmp_path / "dataset", tokenizer=tokenizer, text_field="body", validation_fraction=0, progress=False
    )
    dataset = PreparedDataset.open(tmp_path / "dataset")
    eot = 70_001
    assert dataset.manifest["dtype"] == "uint32" and dataset.vocab_size == 70_002 and dataset.eot_id == eot
    assert dataset.manifest["text_field"] == "body" and dataset.tokens("validation") == 0
    (shard,) = dataset.shards("train")
    assert shard.tolist() == [69999, 1, 65536, eot, 0, 70_000, eot, 5, eot]


def test_an_interrupted_prepare_run_again_writes_what_an_uninterrupted_run_writes(tmp_path, caplog):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    # Over two chunks of text: pieces of one document, joined again with no end-of-text between them.
    long_text = "".join(f"line {i}: ünïcödé and ascii alike\n" for i in range(80_000))
    (corpus / "long.txt").write_text(long_text)
    (corpus / "short.jsonl").write_text("".join(json.dumps({"text": f"short {i}"}) + "\n" for i in range(40)))
    # Prepare reads its sources in order and blocks on this named pipe until someone writes to it, so it is killed
    # while it still has work left, whenever the finished chunks show up.
    held = tmp_path / "held.txt"
    os.mkfifo(held)
    out = tmp_path / "dataset"
    options = ["--bytes", "--validation-fraction", "0.2", "--shard-tokens", "1000000"]
    log = tmp_path / "prepare.log"
    with open(log, "wb") as output:
        command = [sys.executable, "-m", "trainer.data", "prepare", str(corpus), str(held), "--out", str(out)]
        process = subprocess.Popen(
            [*command, *options, "--workers", "2"], cwd=ROOT, stdout=output, stderr=output, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 120
        while not list((out / WORK_DIR).glob("*.npz")):
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"no chunk finished; prepare's output:\n{log.read_text()}"
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert not (out / MANIFEST).exists()

    held.unlink()
    held.write_text("the held document")
    arguments = dict(byte_level_tokens=True, validation_fraction=0.2, shard_tokens=1_000_000, workers=1, progress=False)
    with caplog.at_level("INFO", logger="trainer.data.prepare"):
        resumed = prepare([corpus, held], out, **arguments)
    assert "reused" in caplog.text
    reference = prepare([corpus, held], tmp_path / "reference", **arguments)

    assert sorted(path.name for path in out.iterdir()) == sorted(
        path.name for path in (tmp_path / "reference").iterdir()
    )
    for path in out.glob("*.bin"):
        assert path.read_bytes() == (tmp_path / "reference" / path.name).read_bytes()
    assert {**resumed, "created_at": None} == {**reference, "created_at": None}
    dataset = PreparedDataset.open(out)
    assert long_text in decoded_documents(dataset, "train") + decoded_documents(dataset, "validation")


def test_the_split_depends_on_paths_inside_the_input_not_where_the_corpus_lies(corpus, byte_dataset, tmp_path):
    directory, _ = corpus
    moved = tmp_path / "elsewhere" / directory.name
    moved.parent.mkdir()
    os.symlink(directory, moved, target_is_directory=True)
    prepare(
        [moved],
        tmp_path / "dataset",
        byte_level_tokens=True,
        validation_fraction=VALIDATION_FRACTION,
        shard_tokens=SHARD_TOKENS,
        progress=False,
        workers=1,
    )
    for split in SPLITS:
        assert decoded_documents(PreparedDataset.open(tmp_path / "dataset"), split) == decoded_documents(
            byte_dataset, split
        )


def test_an_empty_validation_split_is_refused_with_the_count_of_documents(tmp_path):
    (tmp_path / "one.txt").write_text("a single document")
    with pytest.raises(PrepareError, match="none of the 1 documents") as refusal:
        prepare([tmp_path / "one.txt"], tmp_path / "dataset", byte_level_tokens=True, progress=False, workers=1)
    assert refusal.value.field == "validation_fraction"
    assert not (tmp_path / "dataset").exists()


def bad_jsonl(tmp_path: Path) -> dict:
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    return dict(inputs=[tmp_path / "bad.jsonl"], byte_level_tokens=True)


def unknown_extension(tmp_path: Path) -> dict:
    (tmp_path / "table.csv").write_text("text\nhello\n")
    return dict(inputs=[tmp_path / "table.csv"], byte_level_tokens=True)


def tokenizer_without_eot(tmp_path: Path) -> dict:
    (tmp_path / "a.txt").write_text("w1 w2")
    tokenizer = word_level_tokenizer(tmp_path / "words.json", 10, ["[UNK]"])
    return dict(inputs=[tmp_path / "a.txt"], tokenizer=tokenizer)


@pytest.mark.parametrize(
    ("make", "field", "message"),
    [
        (lambda tmp_path: dict(inputs=[tmp_path / "missing.txt"], byte_level_tokens=True), "inputs", "no such file"),
        (bad_jsonl, "text_field", r"bad.jsonl, line 2: no field 'text' \(it has \['body'\]\)"),
        (unknown_extension, "inputs", "unknown kind of file '.csv'"),
        (tokenizer_without_eot, "tokenizer", "none of the end-of-text tokens .* --eot-token"),
        (lambda tmp_path: dict(inputs=[tmp_path], vocab_size=100), "vocab_size", "between 257 and"),
    ],
    ids=["missing-file", "jsonl-without-field", "unknown-extension", "tokenizer-without-eot", "vocab-too-small"],
)
def test_bad_input_is_refused_naming_the_field_and_leaves_no_dataset(tmp_path, make, field, message):
    arguments = make(tmp_path)
    with pytest.raises(PrepareError, match=message) as refusal:
        prepare(out=tmp_path / "dataset", validation_fraction=0, progress=False, workers=1, **arguments)
    assert refusal.value.field == field
    assert not (tmp_path / "dataset").exists()


def test_the_command_line_names_the_option_to_change_and_inspects_a_dataset(byte_dataset, tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"body": "no text field"}\n')
    assert main(["prepare", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "dataset"), "--bytes"]) == 2
    assert "error: --text-field: " in capsys.readouterr().err
    (tmp_path / "a.txt").write_text("text")
    assert main(["prepare", str(tmp_path / "a.txt"), "--out", str(byte_dataset.path), "--bytes"]) == 2
    assert "error: --out: " in capsys.readouterr().err
    assert main(["inspect", str(byte_dataset.path)]) == 0
    shown = capsys.readouterr().out
    assert "tokenizer: bytes, vocabulary 257" in shown
    assert f"{byte_dataset.tokens('train'):,} tokens" in shown
    assert decoded_documents(byte_dataset, "train")[0][:50] in shown
