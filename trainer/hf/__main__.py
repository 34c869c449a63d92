"""`python -m trainer.hf import HF_DIR --out CHECKPOINT_DIR [--seq-len N]` and
`python -m trainer.hf export CHECKPOINT_DIR --out HF_DIR [--tokenizer-from DATASET_DIR] [--dtype float32|bfloat16]`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from trainer.checkpoint import CheckpointError
from trainer.data.format import DatasetError
from trainer.hf.exporting import DTYPES, export_checkpoint
from trainer.hf.importing import import_model

USAGE_EXIT_CODE = 2


def parser() -> argparse.ArgumentParser:
    commands = argparse.ArgumentParser(prog="python -m trainer.hf", description=__doc__.splitlines()[0])
    actions = commands.add_subparsers(dest="action", required=True)
    importing = actions.add_parser("import", help="a local Hugging Face Llama directory → a loom checkpoint")
    importing.add_argument("hf_dir", type=Path, help="directory with config.json and *.safetensors")
    importing.add_argument("--out", type=Path, required=True, help="the checkpoint directory to write")
    importing.add_argument("--seq-len", type=int, help="model.seq_len (default: max_position_embeddings)")
    exporting = actions.add_parser("export", help="a committed loom checkpoint → a Hugging Face Llama directory")
    exporting.add_argument("checkpoint_dir", type=Path, help="a committed checkpoint (step-NNNNNN or an import)")
    exporting.add_argument("--out", type=Path, required=True, help="the directory to write (new or empty)")
    exporting.add_argument(
        "--tokenizer-from",
        type=Path,
        help="the prepared dataset whose tokenizer to include (default: the one the checkpoint's run trained on)",
    )
    exporting.add_argument("--dtype", choices=list(DTYPES), default="float32", help="dtype of the exported weights")
    return commands


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.action == "import":
            model = import_model(args.hf_dir, args.out, args.seq_len)
            print(json.dumps({"checkpoint": str(args.out.absolute()), "model": model}, indent=2))
        else:
            out = export_checkpoint(args.checkpoint_dir, args.out, args.tokenizer_from, args.dtype)
            print(out)
    except (CheckpointError, DatasetError, OSError, ValueError) as error:
        print(f"trainer.hf {args.action}: {error}", file=sys.stderr)
        return USAGE_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
