"""A committed loom checkpoint → a Hugging Face Llama directory that transformers' from_pretrained loads.

The checkpoint's model state is read on one process, without a process group, whatever layout saved it (DCP
reshards it into full tensors); written as safetensors under Hugging Face's names, split into shards with an
index when it is large, beside a config.json and, when the dataset it was trained on has one, its tokenizer.
"""

from __future__ import annotations

import json
import logging
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from pydantic import ValidationError
from safetensors.torch import save_file

from trainer.checkpoint import CheckpointError, verify
from trainer.config import ModelConfig
from trainer.data.format import TOKENIZER_FILE, PreparedDataset
from trainer.hf.dcp_files import single_process
from trainer.hf.names import hf_config, hf_name
from trainer.model import Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Hugging Face's own default shard size.
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HF_CONFIG = "config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
README = "README.md"

logger = logging.getLogger("trainer.hf.exporting")


def model_of(manifest: dict[str, Any], checkpoint_dir: Path) -> ModelConfig:
    """The checkpoint's model section; fields added after it was written take their defaults, as on resume."""
    try:
        model = ModelConfig.model_validate(manifest.get("model") or {})
    except ValidationError as error:
        raise CheckpointError(f"{checkpoint_dir.name}: its manifest's model section is invalid ({error})") from None
    unlike_llama = {
        "tied embeddings": model.tie_embeddings,
        f"{model.experts} experts": model.experts > 1,
        f"{model.mlp} feed-forward blocks": model.mlp != "swiglu",
        "parallel attention and MLP blocks (model.parallel_blocks)": model.parallel_blocks,
    }
    differences = [what for what, differs in unlike_llama.items() if differs]
    if differences:
        raise CheckpointError(
            f"{checkpoint_dir.name}: its model has {', '.join(differences)}; the export writes Hugging Face's Llama "
            "(untied, dense, SwiGLU, attention then the MLP)"
        )
    return model


def load_model_state(checkpoint_dir: Path, model: ModelConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's full fp32 parameters under loom's names, read on this process alone."""
    with torch.device("meta"):
        shapes = {name: parameter.shape for name, parameter in Transformer(model).named_parameters()}
    state = {name: torch.empty(shape, dtype=torch.float32) for name, shape in shapes.items()}
    try:
        with single_process():
            dcp.load({"model": state}, checkpoint_id=checkpoint_dir, no_dist=True)
    except Exception as error:  # DCP raises its own CheckpointException, or RuntimeError, for a missing key
        raise CheckpointError(f"{checkpoint_dir.name}: its model state does not load ({error})") from None
    return state


def shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors, each at most max_shard_bytes unless one tensor alone is larger."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = tensor
        size += nbytes
    return groups


def write_weights(directory: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[str]:
    """model.safetensors, or numbered shards and their index; returns the files written."""
    groups = shards(tensors, max_shard_bytes)
    # transformers reads the "format" entry to tell PyTorch tensors from other frameworks'.
    metadata = {"format": "pt"}
    if len(groups) == 1:
        save_file(groups[0], directory / SINGLE_FILE, metadata=metadata)
        return [SINGLE_FILE]
    names = [f"model-{index:05d}-of-{len(groups):05d}.safetensors" for index in range(1, len(groups) + 1)]
    weight_map = {}
    for name, group in zip(names, groups, strict=True):
        save_file(group, directory / name, metadata=metadata)
        weight_map |= dict.fromkeys(group, name)
    total = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return [*names, INDEX_FILE]


def trained_on(manifest: dict[str, Any]) -> Path | None:
    """The prepared dataset the checkpoint's run trained on, as its manifest names it; None for the demo corpus,
    an import, or a dataset no longer where it was."""
    dataset = (manifest.get("data") or {}).get("dataset")
    path = Path(dataset["path"]) if isinstance(dataset, dict) and isinstance(dataset.get("path"), str) else None
    return path if path is not None and path.is_dir() else None


def tokenizer_note(directory: Path, dataset: PreparedDataset | None, seq_len: int) -> str:
    """Copies the dataset's tokenizer when it has one; says what the token ids mean either way."""
    if dataset is None:
        return (
            "No tokenizer: the checkpoint names no prepared dataset that is still on disk; name one with "
            "--tokenizer-from. (A run on the demo corpus needs none: its ids 0-255 are the bytes of UTF-8 text.)"
        )
    tokenizer = dataset.manifest["tokenizer"]
    if tokenizer["kind"] == "bytes" or not (dataset.path / TOKENIZER_FILE).is_file():
        return (
            f"No tokenizer: {dataset.path} holds byte-level tokens, which need none. Ids 0-255 are the bytes of "
            f"UTF-8 text and id {dataset.eot_id} ends a document."
        )
    shutil.copyfile(dataset.path / TOKENIZER_FILE, directory / TOKENIZER_FILE)
    eot = tokenizer.get("eot_token") or "<|endoftext|>"
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eot, "model_max_length": seq_len}
    (directory / TOKENIZER_CONFIG).write_text(json.dumps(settings, indent=2))
    return f"Tokenizer: {TOKENIZER_FILE} from {dataset.path}; {eot!r} (id {dataset.eot_id}) ends a document."


def export_checkpoint(
    checkpoint_dir: Path,
    out_dir: Path,
    tokenizer_dir: Path | None = None,
    dtype: str = "float32",
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write the committed checkpoint as a Hugging Face Llama directory at out_dir (which must not hold anything
    yet); returns out_dir. tokenizer_dir: the prepared dataset whose tokenizer goes with the model; None takes the
    one the checkpoint's manifest says the run trained on, when it is still there."""
    checkpoint_dir, out_dir = Path(checkpoint_dir).absolute(), Path(out_dir).absolute()
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: must be one of {', '.join(DTYPES)}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir}: exists and is not empty; choose another output directory")
    manifest = verify(checkpoint_dir)
    model = model_of(manifest, checkpoint_dir)
    tokenizer_dir = tokenizer_dir if tokenizer_dir is not None else trained_on(manifest)
    dataset = PreparedDataset.open(tokenizer_dir) if tokenizer_dir is not None else None
    if dataset is not None and dataset.vocab_size > model.vocab:
        raise ValueError(
            f"{dataset.path}: its tokenizer has {dataset.vocab_size} ids, more than the model's vocab {model.vocab}"
        )
    state = load_model_state(checkpoint_dir, model)
    tensors = {hf_name(name): tensor.to(DTYPES[dtype]).contiguous() for name, tensor in state.items()}
    del state
    temporary = out_dir.with_name(f"{out_dir.name}.tmp-{secrets.token_hex(4)}")
    temporary.mkdir(parents=True)
    try:
        files = write_weights(temporary, tensors, max_shard_bytes)
        eos = dataset.eot_id if dataset is not None else None
        (temporary / HF_CONFIG).write_text(json.dumps(hf_config(model, dtype, eos), indent=2))
        note = tokenizer_note(temporary, dataset, model.seq_len)
        readme = (
            f"# A loom checkpoint as a Hugging Face Llama\n\nExported from {checkpoint_dir} (step {manifest['step']}) "
            f"as {dtype}: {', '.join(files)}.\n\n{note}\n"
        )
        (temporary / README).write_text(readme)
        if out_dir.exists():
            out_dir.rmdir()
        temporary.rename(out_dir)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    logger.info("exported %s to %s (%s). %s", checkpoint_dir, out_dir, dtype, note)
    return out_dir
