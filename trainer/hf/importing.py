"""A local Hugging Face Llama directory → a committed loom checkpoint that `checkpoint.init_from` starts runs from.

The weights are converted once, into fp32 (the trainer's master weights) under loom's names, and saved through
DCP like every other checkpoint, so each layout loads its own shards of them. Safetensors files are read tensor
by tensor: the model is held in memory once, as the checkpoint being written.
"""

from __future__ import annotations

import json
import logging
import secrets
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

from trainer.checkpoint import MANIFEST, MANIFEST_FORMAT, commit
from trainer.config import ModelConfig
from trainer.hf.dcp_files import single_process
from trainer.hf.names import ImportRefused, hf_name, is_derived, loom_name, model_section, ties_embeddings
from trainer.model import Transformer

__all__ = ["ImportRefused", "import_model"]

HF_CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

logger = logging.getLogger("trainer.hf.importing")


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    path = hf_dir / HF_CONFIG
    if not path.is_file():
        raise ImportRefused({HF_CONFIG: f"missing from {hf_dir}: a Hugging Face model directory has one"})
    try:
        document = json.loads(path.read_text())
    except ValueError as error:
        raise ImportRefused({HF_CONFIG: f"is not valid JSON ({error})"}) from None
    if not isinstance(document, dict):
        raise ImportRefused({HF_CONFIG: "must hold a JSON object"})
    return document


def weight_files(hf_dir: Path) -> dict[Path, list[str] | None]:
    """Each safetensors file to read, with the tensor names the index assigns it (None: all it holds)."""
    index_path = hf_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as error:
            raise ImportRefused({INDEX_FILE: f"has no readable weight_map ({error!r})"}) from None
        files: dict[Path, list[str] | None] = {}
        for name, file in weight_map.items():
            files.setdefault(hf_dir / file, []).append(name)
        absent = sorted(path.name for path in files if not path.is_file())
        if absent:
            raise ImportRefused({INDEX_FILE: f"names files that are missing: {', '.join(absent)}"})
        return files
    if (hf_dir / SINGLE_FILE).is_file():
        return {hf_dir / SINGLE_FILE: None}
    raise ImportRefused(
        {
            SINGLE_FILE: f"missing from {hf_dir}, and no {INDEX_FILE} either; loom reads safetensors only "
            "(save the model with save_pretrained, which writes them)"
        }
    )


def read_weights(hf_dir: Path, model: ModelConfig, tied: bool) -> dict[str, torch.Tensor]:
    """Every parameter of loom's model, in fp32 under loom's names; ImportRefused names any tensor that is
    missing, misshapen or has no place in the model."""
    with torch.device("meta"):
        expected = {name: tuple(parameter.shape) for name, parameter in Transformer(model).named_parameters()}
    weights: dict[str, torch.Tensor] = {}
    errors: dict[str, str] = {}
    for path, names in weight_files(hf_dir).items():
        with safe_open(str(path), framework="pt") as file:
            for hf_tensor in names if names is not None else file.keys():
                name = loom_name(hf_tensor)
                if name is None:
                    if not is_derived(hf_tensor):
                        errors[hf_tensor] = "has no place in a Llama model loom can build; not imported"
                    continue
                if tied and name == "output.weight":
                    continue
                if name not in expected:
                    errors[hf_tensor] = f"names a layer past num_hidden_layers = {model.layers}"
                    continue
                shape = tuple(file.get_slice(hf_tensor).get_shape())
                if shape != expected[name]:
                    errors[hf_tensor] = f"has shape {list(shape)}; config.json implies {list(expected[name])}"
                    continue
                weights[name] = file.get_tensor(hf_tensor).to(torch.float32)
    if tied and "embedding.weight" in weights:
        # Untied: the output projection starts as a copy of the embedding, which gives the same logits.
        weights["output.weight"] = weights["embedding.weight"].clone()
    for name in expected.keys() - weights.keys():
        errors.setdefault(hf_name(name), "missing from the safetensors files")
    if errors:
        raise ImportRefused(dict(sorted(errors.items())))
    return weights


def import_manifest(hf_dir: Path, hf_config: dict[str, Any], model: ModelConfig) -> dict[str, Any]:
    """A checkpoint manifest for weights that no run has trained yet: step 0, one process, no optimizer state."""
    return {
        "format": MANIFEST_FORMAT,
        "run_id": None,
        "attempt": None,
        "step": 0,
        "created_at": datetime.now(UTC).isoformat(),
        "layout": None,
        "world_size": 1,
        "model": model.model_dump(),
        "parent": None,
        "data": None,
        "rng": None,
        "lr_schedule": None,
        "loss": None,
        "source": {"kind": "huggingface", "path": str(hf_dir), "config": hf_config},
    }


def import_model(hf_dir: Path, out_dir: Path, seq_len: int | None = None) -> dict:
    """Convert the Hugging Face Llama in hf_dir into a committed checkpoint at out_dir; returns its model section.

    out_dir may replace an earlier checkpoint, never a directory that is something else."""
    hf_dir, out_dir = Path(hf_dir).absolute(), Path(out_dir).absolute()
    if out_dir.exists() and not (out_dir / MANIFEST).is_file():
        raise FileExistsError(f"{out_dir}: exists and is not a checkpoint; choose another output directory")
    hf_config = read_hf_config(hf_dir)
    model = model_section(hf_config, seq_len)
    tied = ties_embeddings(hf_config)
    weights = read_weights(hf_dir, model, tied)
    temporary = out_dir.with_name(f"{out_dir.name}.tmp-{secrets.token_hex(4)}")
    try:
        with single_process():
            dcp.save({"model": weights}, storage_writer=dcp.FileSystemWriter(temporary), no_dist=True)
        manifest = commit(temporary, out_dir, import_manifest(hf_dir, hf_config, model))
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    logger.info(
        "imported %s into %s: %d tensors, %.1f MB%s",
        hf_dir,
        out_dir,
        len(weights),
        manifest["bytes"] / 1e6,
        " (tied embeddings untied: the output projection starts as a copy of the embedding)" if tied else "",
    )
    return model.model_dump()
