"""A user's own text, end to end: prepared with a tokenizer trained on it, trained on in two ranks with gradient
accumulation and validation loss, stopped at a checkpoint and resumed to exactly the losses of a run that never
stopped."""

import json
import random
import subprocess
import sys

import pytest

from trainer.data.format import PreparedDataset

from .torchrun import ROOT, run_trainer

VOCAB = 384
WORDS = "the a loom trains models ranks shards tokens step loss layer rank weight data batch fast slow".split()


def write_corpus(directory) -> None:
    """Sentences of a few words, as a jsonl file of documents and a plain text file."""
    generator = random.Random(7)

    def document() -> str:
        return ". ".join(" ".join(generator.choices(WORDS, k=generator.randint(4, 12))) for _ in range(40)) + "."

    directory.mkdir()
    (directory / "notes.jsonl").write_text("".join(json.dumps({"text": document()}) + "\n" for _ in range(150)))
    (directory / "essay.txt").write_text("\n".join(document() for _ in range(20)))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("own-data")
    write_corpus(root / "text")
    prepared = root / "prepared"
    command = [sys.executable, "-m", "trainer.data", "prepare", str(root / "text"), "--out", str(prepared)]
    command += ["--vocab-size", str(VOCAB), "--validation-fraction", "0.1", "--workers", "2"]
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    return prepared


def run_config(dataset, checkpoints, **checkpoint) -> dict:
    return {
        "steps": 6,
        "model": {"layers": 2, "dim": 32, "heads": 2, "kv_heads": 1, "ffn": 64, "seq_len": 32, "vocab": VOCAB},
        "parallel": {"dp_shard": 2},
        "compute": {"precision": "fp32"},
        "optimizer": {"warmup_steps": 1},
        "data": {"dataset": str(dataset), "micro_batch": 2, "global_batch": 8},
        "eval": {"interval_steps": 3, "batches": 2},
        "checkpoint": {"directory": str(checkpoints), "async_save": False, **checkpoint},
        "telemetry": {"flush_interval_s": 0.2, "heartbeat_interval_s": 60, "comm": False},
    }


@pytest.mark.slow
def test_prepared_text_trains_with_accumulation_and_validation_and_resumes_exactly(dataset, tmp_path):
    prepared = PreparedDataset.open(dataset)
    # BPE stops merging when the corpus offers no more pairs: the model's vocabulary is at least the tokenizer's.
    assert prepared.manifest["tokenizer"]["kind"] == "trained" and 257 < prepared.vocab_size <= VOCAB
    assert prepared.tokens("validation") > 0

    whole = run_trainer(tmp_path / "whole", run_config(dataset, tmp_path / "whole-ckpt", interval_steps=3))
    assert whole.returncode == 0, whole.failure_report()
    losses = whole.loss_means()
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert sorted(whole.eval_losses()[0]) == [3, 6]

    checkpoint = tmp_path / "whole-ckpt" / "step-000003"
    resumed = run_trainer(tmp_path / "resumed", run_config(dataset, tmp_path / "resumed-ckpt", resume=str(checkpoint)))
    assert resumed.returncode == 0, resumed.failure_report()
    assert resumed.loss_means() == losses[3:]
    assert resumed.eval_losses()[0] == {6: whole.eval_losses()[0][6]}
