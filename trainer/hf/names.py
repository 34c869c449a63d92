"""How a Hugging Face Llama and a loom Transformer name the same things: parameters, and config fields.

Pure Python (no torch), so the platform can check a config.json without loading weights. Both models lay RoPE
out the rotate-half way, so the query and key projections map one to one, with no permutation; Llama 3.1's
frequency scaling ("llama3") maps to model.rope_scaling, other scalings are refused.

Tied embeddings (one matrix for the token embedding and the output projection) are untied on import: the trainer
keeps the two apart, and a copy of the embedding as the output projection gives the same logits, so models saved
tied (many small Llamas are) still import. They train as two matrices from then on, and export writes them so.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from trainer.config import ModelConfig, field_errors

# Outside the blocks.
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "embedding.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
# Inside block i: model.layers.{i}.<HF suffix> ↔ blocks.{i}.<loom suffix>.
BLOCK_NAMES = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "mlp.w1.weight",
    "mlp.up_proj.weight": "mlp.w3.weight",
    "mlp.down_proj.weight": "mlp.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
}
HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
LOOM_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")
# Older transformers saved the RoPE frequencies as a buffer; they follow from the config, as loom's do.
DERIVED_HF_TENSOR = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
HF_FROM_LOOM_BLOCK = {loom: hf for hf, loom in BLOCK_NAMES.items()}
HF_FROM_LOOM_GLOBAL = {loom: hf for hf, loom in GLOBAL_NAMES.items()}

# Which config.json field each loom model field comes from, to name it when loom refuses the value.
HF_FIELDS = {
    "dim": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "ffn": "intermediate_size",
    "vocab": "vocab_size",
    "seq_len": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "rope_scaling": "rope_parameters",
}
REQUIRED_HF_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
# transformers' LlamaConfig defaults, for the fields a config.json may leave out.
HF_ROPE_THETA = 10_000.0
HF_RMS_NORM_EPS = 1e-6
HF_MAX_POSITIONS = 2048
SUPPORTED_ROPE_TYPES = ("default", "llama3")


class ImportRefused(ValueError):
    """A Hugging Face model loom cannot run as it is; `errors` maps each config field (or tensor) to why."""

    def __init__(self, errors: dict[str, str]):
        self.errors = errors
        super().__init__("; ".join(f"{field}: {message}" for field, message in errors.items()))


def loom_name(hf_name: str) -> str | None:
    """loom's name for a Hugging Face Llama parameter; None for a name loom has no parameter for."""
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    match = HF_BLOCK.match(hf_name)
    if match and match[2] in BLOCK_NAMES:
        return f"blocks.{match[1]}.{BLOCK_NAMES[match[2]]}"
    return None


def hf_name(loom_name: str) -> str:
    """The Hugging Face Llama name of a loom parameter."""
    if loom_name in HF_FROM_LOOM_GLOBAL:
        return HF_FROM_LOOM_GLOBAL[loom_name]
    match = LOOM_BLOCK.match(loom_name)
    if match and match[2] in HF_FROM_LOOM_BLOCK:
        return f"model.layers.{match[1]}.{HF_FROM_LOOM_BLOCK[match[2]]}"
    raise KeyError(f"{loom_name}: no Hugging Face Llama parameter corresponds to it")


def is_derived(hf_name: str) -> bool:
    """Whether a tensor in a Hugging Face checkpoint is recomputed from the config rather than learned."""
    return DERIVED_HF_TENSOR.match(hf_name) is not None


def ties_embeddings(hf_config: dict[str, Any]) -> bool:
    return bool(hf_config.get("tie_word_embeddings", False))


def rope_theta_of(hf_config: dict[str, Any]) -> Any:
    """The RoPE base: transformers 5 writes it into rope_parameters, earlier versions at the top level."""
    parameters = hf_config.get("rope_parameters")
    if isinstance(parameters, dict) and parameters.get("rope_theta") is not None:
        return parameters["rope_theta"]
    theta = hf_config.get("rope_theta")
    return HF_ROPE_THETA if theta is None else theta


def rope_scaling_entries(hf_config: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(field, settings) for each place a config.json describes RoPE: rope_scaling (transformers 4),
    rope_parameters (transformers 5)."""
    return [
        (field, hf_config[field])
        for field in ("rope_scaling", "rope_parameters")
        if isinstance(hf_config.get(field), dict)
    ]


def rope_scaling_of(hf_config: dict[str, Any]) -> dict[str, Any] | None:
    """loom's model.rope_scaling for a Llama 3.1-style config.json; None when its RoPE is not scaled."""
    for _, scaling in rope_scaling_entries(hf_config):
        if scaling.get("rope_type", scaling.get("type")) == "llama3":
            return {
                "factor": scaling.get("factor"),
                "low_freq_factor": scaling.get("low_freq_factor"),
                "high_freq_factor": scaling.get("high_freq_factor"),
                "original_context": scaling.get("original_max_position_embeddings"),
            }
    return None


def unsupported_fields(hf_config: dict[str, Any]) -> dict[str, str]:
    """config.json settings loom's Transformer cannot reproduce, each with what would be right."""
    errors: dict[str, str] = {}
    model_type = hf_config.get("model_type")
    if model_type != "llama":
        errors["model_type"] = f'is {model_type!r}; loom imports Llama models (model_type "llama") only'
    for field, scaling in rope_scaling_entries(hf_config):
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in SUPPORTED_ROPE_TYPES:
            errors[f"{field}.rope_type"] = (
                f"is {kind!r}; loom's rotary embedding scales only as Llama 3.1 does: it needs 'llama3' or 'default'"
            )
    for field in ("attention_bias", "mlp_bias"):
        if hf_config.get(field):
            errors[field] = "is true; loom's projections have no biases: it needs false"
    activation = hf_config.get("hidden_act", "silu")
    if activation != "silu":
        errors["hidden_act"] = f"is {activation!r}; loom's SwiGLU gates with silu: it needs 'silu'"
    missing = [field for field in REQUIRED_HF_FIELDS if not isinstance(hf_config.get(field), int)]
    for field in missing:
        errors[field] = "is missing" if field not in hf_config else f"must be an integer, not {hf_config[field]!r}"
    head_dim = hf_config.get("head_dim")
    if not missing and head_dim is not None:
        implied = hf_config["hidden_size"] / hf_config["num_attention_heads"]
        if head_dim != implied:
            errors["head_dim"] = (
                f"is {head_dim}; loom's heads are hidden_size / num_attention_heads = {implied:g} wide: "
                "it needs that (or head_dim null)"
            )
    return errors


def model_section(hf_config: dict[str, Any], seq_len: int | None = None) -> ModelConfig:
    """loom's model section for a Hugging Face Llama config.json; ImportRefused names each field loom cannot run.

    seq_len: the run's sequence length; None takes max_position_embeddings."""
    errors = unsupported_fields(hf_config)
    if errors:
        raise ImportRefused(errors)
    heads = hf_config["num_attention_heads"]
    document = {
        "dim": hf_config["hidden_size"],
        "layers": hf_config["num_hidden_layers"],
        "heads": heads,
        "kv_heads": hf_config.get("num_key_value_heads") or heads,
        "ffn": hf_config["intermediate_size"],
        "vocab": hf_config["vocab_size"],
        "seq_len": seq_len if seq_len is not None else hf_config.get("max_position_embeddings") or HF_MAX_POSITIONS,
        "rope_theta": rope_theta_of(hf_config),
        "norm_eps": hf_config.get("rms_norm_eps", HF_RMS_NORM_EPS),
        "rope_scaling": rope_scaling_of(hf_config),
    }
    try:
        return ModelConfig.model_validate(document)
    except ValidationError as error:
        sources = {**HF_FIELDS, "seq_len": "--seq-len" if seq_len is not None else HF_FIELDS["seq_len"]}
        refused = {}
        for field, message in field_errors(error).items():
            refused[sources.get(field, field)] = f"{message} (loom's model.{field} takes it)"
        raise ImportRefused(refused) from None


def hf_rope(model: ModelConfig) -> dict[str, Any]:
    """rope_parameters (and, for transformers 4, rope_scaling) as a LlamaConfig spells loom's RoPE."""
    scaling = model.rope_scaling
    if scaling is None:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta}, "rope_scaling": None}
    llama3 = {
        "rope_type": "llama3",
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_context,
    }
    return {"rope_parameters": {**llama3, "rope_theta": model.rope_theta}, "rope_scaling": llama3}


def hf_config(model: ModelConfig, dtype: str, eos_token_id: int | None = None) -> dict[str, Any]:
    """A Hugging Face LlamaConfig document for loom's model section, read by transformers 4 and 5 alike."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model.dim,
        "num_hidden_layers": model.layers,
        "num_attention_heads": model.heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.dim // model.heads,
        "intermediate_size": model.ffn,
        "vocab_size": model.vocab,
        "hidden_act": "silu",
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        **hf_rope(model),
        "max_position_embeddings": model.seq_len,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "torch_dtype": dtype,
    }
