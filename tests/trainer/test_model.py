import pytest
import torch

from trainer.config import ComputeConfig, ModelConfig
from trainer.model import Transformer, rotary_tables
from trainer.parallel.recompute import apply_recompute

TINY = ModelConfig(layers=2, dim=32, heads=4, kv_heads=4, ffn=64, vocab=256, seq_len=16)


def tokens(batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def test_logits_have_one_row_per_token_over_the_vocabulary():
    torch.manual_seed(0)
    model = Transformer(TINY)
    assert model(tokens(3, 16)).shape == (3, 16, 256)
    assert model(tokens(2, 5)).shape == (2, 5, 256)


def test_a_later_token_does_not_change_earlier_logits():
    torch.manual_seed(0)
    model = Transformer(TINY).eval()
    original = tokens(1, 16)
    changed = original.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 256
    with torch.no_grad():
        before, after = model(original), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_grouped_query_attention_runs_and_backpropagates():
    torch.manual_seed(0)
    config = TINY.model_copy(update={"kv_heads": 2})
    model = Transformer(config)
    attention = model.blocks["0"].attention
    assert attention.wk.weight.shape == (2 * 8, 32)
    logits = model(tokens(2, 16))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens(2, 16, seed=1).flatten())
    loss.backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


def test_grouped_query_attention_equals_attention_with_repeated_key_value_heads():
    torch.manual_seed(0)
    grouped = Transformer(TINY.model_copy(update={"kv_heads": 2})).eval()
    full = Transformer(TINY).eval()
    state = grouped.state_dict()
    for index in range(TINY.layers):
        for projection in ("wk", "wv"):
            key = f"blocks.{index}.attention.{projection}.weight"
            # Each key/value head serves two consecutive query heads: repeat its rows head by head.
            state[key] = state[key].view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
    full.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(full(tokens(2, 16)), grouped(tokens(2, 16)))


def test_rotary_tables_are_not_saved_and_parameters_are_counted():
    model = Transformer(TINY)
    assert not any(key.startswith("rope_") for key in model.state_dict())
    per_block = 4 * 32 * 32 + 3 * 32 * 64 + 2 * 32
    assert model.num_params() == 2 * 256 * 32 + TINY.layers * per_block + 32


def test_rotary_tables_are_built_with_the_models_rope_theta():
    llama3 = Transformer(ModelConfig(**{**TINY.model_dump(), "rope_theta": 500_000.0}))
    cos, sin = rotary_tables(TINY.seq_len, TINY.dim // TINY.heads, 500_000.0)
    torch.testing.assert_close(llama3.rope_cos, cos)
    torch.testing.assert_close(llama3.rope_sin, sin)
    assert not torch.allclose(llama3.rope_cos, Transformer(TINY).rope_cos)


def test_sequences_longer_than_the_model_are_refused():
    with pytest.raises(ValueError, match="model.seq_len=16"):
        Transformer(TINY)(tokens(1, 17))


def test_the_chunked_loss_equals_cross_entropy_of_the_logits_and_their_gradients():
    torch.manual_seed(0)
    model = Transformer(TINY)
    inputs, targets = tokens(3, 16), tokens(3, 16, seed=1)
    fused = model(inputs, targets)
    fused.backward()
    fused_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    plain = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    plain.backward()
    torch.testing.assert_close(fused, plain)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(fused_grads[name], parameter.grad, msg=name)


def test_a_document_mask_makes_a_packed_document_see_only_itself():
    """RoPE scores depend on relative positions only, so a document after an end-of-text token, masked off from
    what precedes it, gets the logits it gets on its own; unmasked, the earlier document changes them."""
    eot = 255
    torch.manual_seed(0)
    model = Transformer(TINY).eval()
    first, second = tokens(1, 6, seed=1) % eot, tokens(1, 9, seed=2) % eot
    packed = torch.cat([first, torch.tensor([[eot]]), second], dim=1)
    with torch.no_grad():
        alone = model(second)
        unmasked = model(packed)[:, 7:]
        model.document_end = eot
        masked = model(packed)[:, 7:]
        masked_prefix = model(packed)[:, :7]
    torch.testing.assert_close(masked, alone, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(unmasked, alone, atol=1e-3)
    model.document_end = None
    with torch.no_grad():
        torch.testing.assert_close(masked_prefix, model(packed)[:, :7])


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_a_parallel_block_adds_attention_and_the_mlp_of_one_norm_to_its_input(mlp):
    torch.manual_seed(0)
    model = Transformer(TINY.model_copy(update={"parallel_blocks": True, "mlp": mlp}))
    block = model.blocks["0"]
    x = torch.randn(2, 16, 32)
    normed = block.attention_norm(x)
    by_hand = x + block.attention(normed, model.rope_cos, model.rope_sin) + block.mlp(normed)
    torch.testing.assert_close(block(x, model.rope_cos, model.rope_sin), by_hand)
    assert block.mlp_norm is None
    assert not any("mlp_norm" in name for name in model.state_dict())
    sequential = Transformer(TINY.model_copy(update={"mlp": mlp}))
    assert model.num_params() == sequential.num_params() - TINY.layers * TINY.dim


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_a_recomputed_parallel_block_gives_the_gradients_it_gives_whole(recompute):
    """Selective recompute reruns the attention alone; the shared norm, whose output the MLP keeps, stays outside."""
    config = TINY.model_copy(update={"parallel_blocks": True})
    inputs, targets = tokens(2, 16), tokens(2, 16, seed=1)
    gradients = []
    for mode in ("none", recompute):
        torch.manual_seed(0)
        model = Transformer(config)
        apply_recompute(model, ComputeConfig(recompute=mode))
        model(inputs, targets).backward()
        # The checkpoint wrapper puts its own prefix into the parameters' names: the order is the same.
        gradients.append([parameter.grad for parameter in model.parameters()])
    names = [name for name, _ in Transformer(config).named_parameters()]
    for name, whole, recomputed in zip(names, *gradients, strict=True):
        torch.testing.assert_close(recomputed, whole, msg=name)
