"""The data path's cost: how fast `prepare` turns text into token shards, and what the sampler adds to a step.

    .venv/bin/python benchmarks/data_pipeline.py            # 64 MB of text; sampler datasets of 10 MB and 1 GB
    .venv/bin/python benchmarks/data_pipeline.py --quick    # 8 MB of text; sampler datasets of 10 MB and 100 MB

1. Prepare throughput. Synthetic text (documents of Zipf-distributed words, the same every run) is written as .jsonl
   files; a BPE of 8,192 tokens is trained on a sample of it, then `python -m trainer.data prepare` tokenizes the
   whole corpus with that tokenizer file on every core, and once more as byte-level tokens, each timed as the
   whole command (start-up and manifest included). Printed: MB of text per second, per core.
2. Sampler cost. Two datasets of random tokens, the smaller and the larger size, are written as shards; the
   demo model's step (4 layers, dim 128, seq_len 128, micro_batch 8: the `bin/up` demo, one process, forward,
   backward and AdamW) is timed, and in the same run the sampler's batch for a step on each dataset. Printed: the
   median of each, the sampler's share of a step (goal: under 2 %) and the larger dataset's sampler time over the
   smaller's (goal: no growth with dataset size, about 1). The shards were just written, so they are read from the
   page cache, as a dataset in use is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from trainer.config import parse_config
from trainer.data.format import FORMAT, MANIFEST, PreparedDataset, token_dtype
from trainer.data.order import data_step
from trainer.data.sampler import TokenSampler
from trainer.data.shards import ShardWriter
from trainer.model import Transformer
from trainer.train import build_optimizer

ROOT = Path(__file__).resolve().parents[1]
MB = 1 << 20
WORDS = 20_000
SAMPLER_VOCAB = 8_192
SHARD_TOKENS = 64 * MB
DEMO = {
    "model": {"layers": 4, "dim": 128, "heads": 4, "kv_heads": 2, "ffn": 344, "seq_len": 128, "vocab": SAMPLER_VOCAB},
    "data": {"micro_batch": 8},
}


def synthetic_corpus(directory: Path, total_bytes: int, files: int = 8) -> list[Path]:
    """jsonl files of documents of Zipf-distributed words from a fixed vocabulary of made-up words."""
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocabulary = ["".join(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(WORDS)]
    weights = 1.0 / np.arange(1, WORDS + 1)
    weights /= weights.sum()
    paths = []
    for index in range(files):
        path = directory / f"part-{index:02d}.jsonl"
        written = 0
        with path.open("w") as out:
            while written < total_bytes // files:
                words = rng.choice(WORDS, size=int(rng.integers(100, 1500)), p=weights)
                line = json.dumps({"text": " ".join(vocabulary[word] for word in words) + "."}) + "\n"
                out.write(line)
                written += len(line)
        paths.append(path)
    return paths


def text_bytes(paths: list[Path]) -> int:
    return sum(path.stat().st_size for path in paths)


def prepare_command(inputs: list[Path], out: Path, cores: int, *options: str) -> float:
    """Seconds `python -m trainer.data prepare` takes, run as a user runs it (its workers start light: spawned
    from this script they would import all of it, torch included)."""
    command = [sys.executable, "-m", "trainer.data", "prepare", *map(str, inputs), "--out", str(out)]
    started = time.perf_counter()
    subprocess.run([*command, "--workers", str(cores), *options], check=True, capture_output=True, cwd=ROOT)
    return time.perf_counter() - started


def measure_prepare(work: Path, text_mb: int) -> dict:
    corpus = work / "corpus"
    corpus.mkdir()
    paths = synthetic_corpus(corpus, text_mb * MB)
    cores = len(os.sched_getaffinity(0))
    sample = work / "tokenizer-sample"
    prepare_command(paths[:1], sample, cores, "--vocab-size", str(SAMPLER_VOCAB))
    vocab = PreparedDataset.open(sample).vocab_size
    results = {"text_mb": text_bytes(paths) / MB, "cores": cores, "vocab": vocab}
    for name, options in (("bpe", ("--tokenizer", str(sample / "tokenizer.json"))), ("bytes", ("--bytes",))):
        seconds = prepare_command(paths, work / f"prepared-{name}", cores, *options)
        prepared = PreparedDataset.open(work / f"prepared-{name}")
        tokens = prepared.tokens("train") + prepared.tokens("validation")
        results[name] = {
            "seconds": seconds,
            "mb_per_s_per_core": results["text_mb"] / seconds / cores,
            "tokens_per_s": tokens / seconds,
        }
    return results


def random_dataset(directory: Path, tokens: int) -> Path:
    """A dataset of uniformly random tokens in the documented format (documents are irrelevant to the sampler)."""
    directory.mkdir()
    dtype = token_dtype(SAMPLER_VOCAB)
    eot = SAMPLER_VOCAB - 1
    rng = np.random.default_rng(1)
    splits = {}
    for split, count in (("train", tokens), ("validation", tokens // 100)):
        writer = ShardWriter(directory, split, dtype, SHARD_TOKENS, eot)
        for start in range(0, count, 16 * MB):
            writer.write(rng.integers(0, SAMPLER_VOCAB, size=min(16 * MB, count - start), dtype=dtype))
        splits[split] = writer.close()
    tokenizer = {"kind": "bytes", "file": None, "sha256": None, "vocab_size": SAMPLER_VOCAB, "eot_id": eot}
    manifest = {"format": FORMAT, "dtype": dtype.name, "tokenizer": tokenizer, "splits": splits, "sources": []}
    (directory / MANIFEST).write_text(json.dumps(manifest))
    return directory


def median_seconds(action, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def demo_step_seconds(repeats: int) -> float:
    config = parse_config(DEMO)
    torch.manual_seed(0)
    model = Transformer(config.model)
    optimizer = build_optimizer(list(model.parameters()), config.optimizer)
    tokens = torch.randint(0, SAMPLER_VOCAB, (config.data.micro_batch, config.model.seq_len + 1))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()

    for _ in range(3):
        step()
    return median_seconds(step, repeats)


def sampler_cost(dataset: Path, repeats: int) -> tuple[float, int, float]:
    """The median seconds of a step's batch, the dataset's sequences, and the permutation's evaluations per
    sequence drawn (cycle-walking makes it 1 to 2 on average, by how close the sequences come to a power of 2)."""
    config = parse_config({**DEMO, "data": {**DEMO["data"], "dataset": str(dataset)}})
    sampler = TokenSampler(PreparedDataset.open(dataset), config)
    steps = iter(range(1, repeats + 1))
    seconds = median_seconds(lambda: sampler.batch(data_step(next(steps), [])), repeats)
    evaluations = sampler.permutation(0).evaluations / (repeats * config.global_batch)
    return seconds, sampler.train.count, evaluations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 MB of text, sampler datasets of 10 MB and 100 MB")
    parser.add_argument("--directory", type=Path, default=None, help="where to write the data (default: a temp dir)")
    args = parser.parse_args()
    text_mb = 8 if args.quick else 64
    sizes = {"10 MB": 10 * MB, "100 MB" if args.quick else "1 GB": (100 if args.quick else 1024) * MB}
    with tempfile.TemporaryDirectory(dir=args.directory) as temporary:
        work = Path(temporary)
        prepared = measure_prepare(work, text_mb)
        print(
            f"prepare: {prepared['text_mb']:.1f} MB of jsonl text on {prepared['cores']} cores "
            f"(BPE of {prepared['vocab']} tokens trained on a sample)"
        )
        for name in ("bpe", "bytes"):
            figures = prepared[name]
            print(
                f"  {name:5s}: {figures['seconds']:.1f} s, {figures['mb_per_s_per_core']:.2f} MB/s of text per core, "
                f"{figures['tokens_per_s'] / 1e6:.2f} M tokens/s"
            )
        step_s = demo_step_seconds(repeats=20)
        print(f"demo model step (one process, micro_batch 8 × 128 tokens): median {step_s * 1000:.1f} ms")
        sampled = {}
        for label, size in sizes.items():
            dataset = random_dataset(
                work / f"tokens-{label.replace(' ', '')}", size // token_dtype(SAMPLER_VOCAB).itemsize
            )
            sampled[label], sequences, evaluations = sampler_cost(dataset, repeats=200)
            print(
                f"sampler on {label} of tokens ({sequences:,} sequences): median {sampled[label] * 1e6:.0f} µs per "
                f"step, {sampled[label] / step_s:.2%} of a step (goal < 2 %); {evaluations:.2f} permutation "
                "evaluations per sequence"
            )
        small, large = sampled.values()
        print(f"sampler time, {list(sampled)[1]} over 10 MB: {large / small:.2f} (goal: about 1, no growth)")


if __name__ == "__main__":
    main()
