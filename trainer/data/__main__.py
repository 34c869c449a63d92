"""`python -m trainer.data prepare INPUT... --out DIR`: text in, token shards out; `python -m trainer.data inspect
DIR`: what a prepared dataset holds, and a sample of it decoded."""

from __future__ import annotations

import argparse
import logging
import sys

from trainer.data.format import SPLITS, DatasetError, PreparedDataset
from trainer.data.prepare import DEFAULT_SHARD_TOKENS, prepare
from trainer.data.sources import PrepareError

# What the CLI calls each of prepare()'s arguments, for error messages.
OPTIONS = {
    "inputs": "INPUT",
    "out": "--out",
    "tokenizer": "--tokenizer",
    "vocab_size": "--vocab-size",
    "eot_token": "--eot-token",
    "text_field": "--text-field",
    "validation_fraction": "--validation-fraction",
    "workers": "--workers",
    "shard_tokens": "--shard-tokens",
}
SAMPLE_TOKENS = 200


def parser() -> argparse.ArgumentParser:
    commands = argparse.ArgumentParser(prog="python -m trainer.data", description=__doc__)
    subcommands = commands.add_subparsers(dest="command", required=True)
    making = subcommands.add_parser("prepare", help="tokenize text into a prepared dataset")
    making.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help=".txt/.jsonl/.parquet files, directories of them, or a directory written by `datasets`' save_to_disk",
    )
    making.add_argument("--out", required=True, help="the dataset directory to write (new, or an interrupted one)")
    how = making.add_mutually_exclusive_group(required=True)
    how.add_argument("--tokenizer", help="a Hugging Face tokenizer.json (or a directory holding one)")
    how.add_argument("--vocab-size", type=int, help="train a byte-level BPE of this many tokens on the inputs")
    how.add_argument("--bytes", action="store_true", help="byte-level tokens: 256 bytes and an end-of-text token")
    making.add_argument("--eot-token", help="the tokenizer file's end-of-text token, if not one of the usual names")
    making.add_argument("--text-field", default="text", help="the text field of .jsonl records and table columns")
    making.add_argument("--validation-fraction", type=float, default=0.01, help="share of documents held out")
    making.add_argument("--workers", type=int, help="tokenizing processes (default: every CPU)")
    making.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file")
    looking = subcommands.add_parser("inspect", help="summarize a prepared dataset and decode a sample")
    looking.add_argument("dataset", metavar="DIR")
    return commands


def main(argv: list[str] | None = None) -> int:
    arguments = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if arguments.command == "prepare":
            manifest = prepare(
                arguments.inputs,
                arguments.out,
                tokenizer=arguments.tokenizer,
                vocab_size=arguments.vocab_size,
                byte_level_tokens=arguments.bytes,
                eot_token=arguments.eot_token,
                text_field=arguments.text_field,
                validation_fraction=arguments.validation_fraction,
                workers=arguments.workers,
                shard_tokens=arguments.shard_tokens,
            )
            summaries = (f"{split} {_split_summary(manifest, split)}" for split in SPLITS)
            print(f"prepared {arguments.out}: " + "; ".join(summaries))
        else:
            print(describe(PreparedDataset.open(arguments.dataset)))
    except PrepareError as error:
        print(f"error: {OPTIONS.get(error.field, error.field)}: {error.message}", file=sys.stderr)
        return 2
    except DatasetError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def describe(dataset: PreparedDataset) -> str:
    """The manifest in a few lines, then the first tokens of the training split decoded."""
    manifest, tokenizer = dataset.manifest, dataset.manifest["tokenizer"]
    lines = [
        f"{dataset.path}: prepared {manifest['created_at']}",
        f"tokenizer: {tokenizer['kind']}, vocabulary {tokenizer['vocab_size']}, end of text {tokenizer['eot_token']!r} "
        f"(id {tokenizer['eot_id']}), tokens stored as {manifest['dtype']}",
        *(f"{split}: {_split_summary(manifest, split)}" for split in SPLITS),
        f"sources: {len(manifest['sources'])} ({sum(source['bytes'] for source in manifest['sources']):,} bytes)",
    ]
    shards = dataset.shards("train")
    if shards:
        lines += [
            f"first {SAMPLE_TOKENS} training tokens, decoded:",
            dataset.decode(shards[0][:SAMPLE_TOKENS].tolist()),
        ]
    return "\n".join(lines)


def _split_summary(manifest: dict, split: str) -> str:
    entry = manifest["splits"][split]
    return f"{entry['tokens']:,} tokens in {entry['documents']:,} documents, {len(entry['shards'])} shards"


if __name__ == "__main__":
    sys.exit(main())
