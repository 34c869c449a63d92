"""Published model shapes, as `model` sections of the run config.

Vocabularies that do not divide by common tensor-parallel degrees are padded the way Megatron-LM
pads them (to a multiple of 128 × 8): GPT-3's 50,257 tokens become 51,200. The rotary base is each
model's `rope_theta` (Llama 2 10,000, Llama 3 500,000, Mixtral 1,000,000); GPT-3 learns absolute
positions instead, and loom's decoder, which has only rotary ones, keeps the default base for it.
"""

from __future__ import annotations

from trainer.config import ConfigError, ModelConfig

LLAMA2_ROPE_THETA = 10_000.0
LLAMA3_ROPE_THETA = 500_000.0
MIXTRAL_ROPE_THETA = 1_000_000.0


def decoder(layers: int, dim: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq_len: int, **extra) -> dict:
    return {
        "layers": layers, "dim": dim, "heads": heads, "kv_heads": kv_heads, "ffn": ffn, "vocab": vocab,
        "seq_len": seq_len, **extra,
    }  # fmt: skip


MODEL_PRESETS: dict[str, dict] = {
    "loom-tiny": decoder(2, 64, 4, 2, 172, 256, 64),
    "loom-demo": decoder(4, 128, 4, 2, 344, 256, 128),
    "llama2-7b": decoder(32, 4096, 32, 32, 11008, 32000, 4096, rope_theta=LLAMA2_ROPE_THETA),
    "llama2-13b": decoder(40, 5120, 40, 40, 13824, 32000, 4096, rope_theta=LLAMA2_ROPE_THETA),
    "llama2-70b": decoder(80, 8192, 64, 8, 28672, 32000, 4096, rope_theta=LLAMA2_ROPE_THETA),
    "llama3-8b": decoder(32, 4096, 32, 8, 14336, 128256, 8192, rope_theta=LLAMA3_ROPE_THETA),
    "llama3-70b": decoder(80, 8192, 64, 8, 28672, 128256, 8192, rope_theta=LLAMA3_ROPE_THETA),
    "llama3-405b": decoder(126, 16384, 128, 8, 53248, 128256, 8192, rope_theta=LLAMA3_ROPE_THETA),
    "gpt3-175b": decoder(96, 12288, 96, 96, 49152, 51200, 2048, mlp="gelu", tie_embeddings=True),
    "mixtral-8x7b": decoder(32, 4096, 32, 8, 14336, 32000, 32768, experts=8, top_k=2, rope_theta=MIXTRAL_ROPE_THETA),
}


def preset_model(name: str) -> ModelConfig:
    return ModelConfig.model_validate(MODEL_PRESETS[name])


def with_preset(document: dict) -> dict:
    """A run-config document whose `model.preset` names a preset: the preset's fields, then the
    document's own model fields on top (so {"preset": "llama3-8b", "layers": 4} is a shallow copy)."""
    model = document.get("model")
    if not isinstance(model, dict) or "preset" not in model:
        return document
    fields = dict(model)
    name = fields.pop("preset")
    if name not in MODEL_PRESETS:
        raise ConfigError({"model.preset": f"unknown preset {name!r}; valid choices are {list(MODEL_PRESETS)}"})
    return {**document, "model": {**MODEL_PRESETS[name], **fields}}
