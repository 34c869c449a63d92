"""compute.precision fp8: which layers torchao's float8 training takes, and where it may run."""

import torch
from torchao.float8.float8_linear import Float8Linear

from trainer.config import ModelConfig
from trainer.model import Transformer
from trainer.parallel.float8 import apply_float8, fp8_refusal


def test_the_blocks_linear_layers_compute_in_fp8_and_the_output_projection_does_not():
    model = Transformer(ModelConfig(layers=2, dim=64, heads=4, kv_heads=2, ffn=128, seq_len=16))
    assert apply_float8(model, "tensorwise") == 14
    converted = {name for name, module in model.named_modules() if isinstance(module, Float8Linear)}
    assert converted == {
        f"blocks.{layer}.{name}"
        for layer in (0, 1)
        for name in ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "mlp.w1", "mlp.w2", "mlp.w3")
    }
    tokens = torch.randint(0, 256, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens, tokens)
    loss.backward()
    assert model.blocks["0"].attention.wq.weight.grad is not None


def test_a_layer_whose_shape_the_scaled_matmul_cannot_take_stays_as_it_is():
    # kv_heads 1 of head size 8: wk and wv are 8 × 32, not multiples of 16.
    model = Transformer(ModelConfig(layers=1, dim=32, heads=4, kv_heads=1, ffn=64, seq_len=16))
    apply_float8(model, "rowwise")
    attention = model.blocks["0"].attention
    assert isinstance(attention.wq, Float8Linear) and isinstance(attention.wo, Float8Linear)
    assert type(attention.wk) is torch.nn.Linear and type(attention.wv) is torch.nn.Linear


def test_fp8_runs_on_a_cpu():
    assert fp8_refusal(torch.device("cpu")) is None
