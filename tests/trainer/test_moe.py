"""The mixture-of-experts block on one process: routing, dropless and capped dispatch, the grouped GEMM, the
sequence-wise balance loss and the auxiliary-loss-free bias."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.config import ModelConfig, ParallelConfig
from trainer.dense import SwiGLU
from trainer.model import Transformer
from trainer.moe import MoEFeedForward, grouped_matmul
from trainer.parallel.expert import routing_step
from trainer.parallel.mesh import ParallelMesh
from trainer.plan.parameters import active_parameters, total_parameters

EXPERTS, TOP_K, DIM, SEQ_LEN = 4, 2, 16, 12


def moe_block(**moe) -> MoEFeedForward:
    cfg = ModelConfig(dim=DIM, heads=2, kv_heads=2, ffn=32, seq_len=SEQ_LEN, experts=EXPERTS, top_k=TOP_K, moe=moe)
    torch.manual_seed(0)
    block = MoEFeedForward(cfg, Transformer(cfg).kernels)
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return block


def token_by_token(block: MoEFeedForward, x: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
    """What the block must compute: each token through its chosen experts, one at a time, weighted by its gates."""
    tokens = x.reshape(-1, DIM)
    _, chosen, gates = block.router(tokens)
    experts = block.experts
    out = torch.zeros_like(tokens)
    for index, token in enumerate(tokens):
        for slot in range(TOP_K):
            if kept is not None and not kept[index, slot]:
                continue
            expert = int(chosen[index, slot])
            hidden = F.silu(token @ experts.w1[expert].T) * (token @ experts.w3[expert].T)
            out[index] += gates[index, slot] * (hidden @ experts.w2[expert].T)
    return out.view_as(x)


def test_dropless_routing_sends_every_token_to_each_of_its_experts_and_weights_what_comes_back():
    block = moe_block()
    x = torch.randn(3, SEQ_LEN, DIM)
    sent = []

    def dispatch(rows, counts):
        sent.append((rows.shape[0], counts.clone()))
        return block.experts(rows, counts)

    block.dispatch = dispatch
    with torch.no_grad():
        out = block(x)
    ((rows, counts),) = sent
    assert rows == counts.sum() == 3 * SEQ_LEN * TOP_K
    torch.testing.assert_close(out, token_by_token(block, x), rtol=1e-5, atol=1e-5)


def test_a_shared_expert_adds_its_output_to_the_routed_experts_for_every_token():
    routed_only = moe_block()
    with_shared = moe_block(shared_expert=True)
    with_shared.load_state_dict(routed_only.state_dict(), strict=False)
    x = torch.randn(2, SEQ_LEN, DIM)
    with torch.no_grad():
        expected = routed_only(x) + with_shared.shared(x)
        torch.testing.assert_close(with_shared(x), expected)
    assert {name for name, _ in with_shared.named_parameters()} - {n for n, _ in routed_only.named_parameters()} == {
        "shared.w1.weight",
        "shared.w2.weight",
        "shared.w3.weight",
    }


def test_a_capacity_keeps_the_first_tokens_of_each_sequence_an_expert_can_take_and_drops_the_rest():
    block = moe_block(capacity_factor=0.5)
    x = torch.randn(2, SEQ_LEN, DIM)
    capacity = 3  # ceil(0.5 × 12 tokens × top-2 / 4 experts)
    _, chosen, _ = block.router(x.reshape(-1, DIM))
    kept = torch.zeros_like(chosen, dtype=torch.bool)
    for sequence in range(2):
        taken = [0] * EXPERTS
        for index in range(sequence * SEQ_LEN, (sequence + 1) * SEQ_LEN):
            for slot in range(TOP_K):
                expert = int(chosen[index, slot])
                kept[index, slot] = taken[expert] < capacity
                taken[expert] += 1
    out = block(x)
    load, dropped, _ = block.take_statistics()
    assert dropped == int((~kept).sum()) > 0
    assert int(load.sum()) == int(kept.sum())
    assert (load <= 2 * capacity).all()
    torch.testing.assert_close(out, token_by_token(block, x, kept), rtol=1e-5, atol=1e-5)


def test_ties_go_to_the_lower_expert_index():
    block = moe_block()
    with torch.no_grad():
        block.router.weight.zero_()
    _, chosen, gates = block.router(torch.randn(5, DIM))
    assert chosen.tolist() == [[0, 1]] * 5
    torch.testing.assert_close(gates, torch.full((5, TOP_K), 0.5))


@pytest.mark.parametrize("renormalize", [True, False])
def test_sigmoid_gates_are_the_chosen_probabilities_renormalised_over_the_chosen_or_not(renormalize):
    block = moe_block(gate="sigmoid", renormalize=renormalize)
    probabilities, chosen, gates = block.router(torch.randn(6, DIM))
    picked = probabilities.gather(1, chosen)
    assert (probabilities.sum(dim=-1) != 1).all()
    expected = picked / picked.sum(dim=-1, keepdim=True) if renormalize else picked
    torch.testing.assert_close(gates, expected)


@pytest.mark.parametrize("width", [16, 18])
def test_the_grouped_gemm_multiplies_each_experts_rows_by_its_matrix(width):
    # 16 fp32 columns take torch._grouped_mm; 18 (72-byte rows) are not 16-byte aligned and take the loop.
    rows, weight = torch.randn(10, width, dtype=torch.float64).float(), torch.randn(3, 8, width)
    counts = torch.tensor([4, 0, 6])
    expected = torch.cat([rows[:4] @ weight[0].T, rows[4:] @ weight[2].T])
    torch.testing.assert_close(grouped_matmul(rows, weight, counts), expected)


def test_the_balance_loss_is_one_when_load_is_even_and_experts_over_top_k_when_it_all_goes_to_top_k():
    block = moe_block()
    even = torch.full((1, 4, EXPERTS), 1 / EXPERTS)
    round_robin = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]]).reshape(1, -1)
    assert float(block._balance_loss(even, round_robin)) == pytest.approx(1.0)
    collapsed = torch.tensor([[0.5, 0.5, 0.0, 0.0]]).expand(1, 4, EXPERTS)
    always_first_two = torch.tensor([[0, 1]] * 4).reshape(1, -1)
    assert float(block._balance_loss(collapsed, always_first_two)) == pytest.approx(EXPERTS / TOP_K)


def imbalance(block: MoEFeedForward, x: torch.Tensor) -> float:
    with torch.no_grad():
        _, chosen, _ = block.router(x.reshape(-1, DIM))
    load = torch.bincount(chosen.flatten(), minlength=EXPERTS).float()
    return float(load.max() / load.mean())


def skewed_block(**moe) -> MoEFeedForward:
    """A router that favours experts 0 and 1 for tokens leaning one way, which skewed_tokens() all do."""
    block = moe_block(**moe)
    with torch.no_grad():
        block.router.weight[:2] += 0.2
    return block


def skewed_tokens() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(8, SEQ_LEN, DIM) + 0.5


def test_the_balance_loss_evens_out_a_skewed_router():
    block = skewed_block(balance_loss=1.0)
    x = skewed_tokens()
    before = imbalance(block, x)
    optimizer = torch.optim.SGD(block.router.parameters(), lr=0.5)
    for _ in range(40):
        optimizer.zero_grad()
        # Only the balance loss trains the router here: the block's output takes no part in the loss.
        (block(x) * 0).sum().backward()
        optimizer.step()
    assert before >= 1.6
    assert imbalance(block, x) < 1.2


def test_the_balance_loss_trains_the_router_without_changing_the_language_model_loss():
    cfg = dict(layers=2, dim=32, heads=4, kv_heads=2, ffn=64, seq_len=16, experts=4, top_k=2)
    tokens, targets = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    losses, router_grads = [], []
    for weight in (0.0, 1.0):
        torch.manual_seed(0)
        model = Transformer(ModelConfig(**cfg, moe={"balance_loss": weight}))
        loss = model(tokens, targets)
        loss.backward()
        losses.append(float(loss.detach()))
        router_grads.append(model.blocks["0"].mlp.router.weight.grad.clone())
    assert losses[0] == losses[1]
    assert not torch.allclose(router_grads[0], router_grads[1])


def test_evaluation_and_recomputed_forwards_are_not_counted_as_load():
    block = moe_block()
    x = torch.randn(2, SEQ_LEN, DIM, requires_grad=True)
    with torch.no_grad():
        block(x)
    recomputed = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    recomputed.sum().backward()
    load, _, balance_losses = block.take_statistics()
    assert int(load.sum()) == 2 * SEQ_LEN * TOP_K
    assert len(balance_losses) == 1


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield ParallelMesh(ParallelConfig(), 1, "cpu")
    dist.destroy_process_group()


def test_the_bias_update_evens_out_a_skewed_router_without_any_loss(one_rank):
    block = skewed_block(balance_loss=0.0, bias_update_rate=0.01)
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleDict({"0": torch.nn.Module()})
    model.blocks["0"].mlp = block
    x = skewed_tokens()
    before = imbalance(block, x)
    weights = block.router.weight.clone()
    for _ in range(150):
        block(x)
        report = routing_step([model], one_rank, 0.01)
    assert before >= 1.6
    assert imbalance(block, x) < 1.2
    assert torch.equal(block.router.weight, weights)
    assert sum(report["0"]["load"]) == 8 * SEQ_LEN * TOP_K


def test_the_first_dense_layers_keep_a_dense_feed_forward_of_their_own_width_and_the_planner_counts_them():
    cfg = ModelConfig(dim=DIM, heads=2, kv_heads=2, ffn=32, seq_len=SEQ_LEN, experts=EXPERTS, top_k=TOP_K,
                      layers=3, moe={"dense_layers": 1, "dense_ffn": 48})  # fmt: skip
    model = Transformer(cfg)
    assert isinstance(model.blocks["0"].mlp, SwiGLU) and model.blocks["0"].mlp.w1.weight.shape == (48, DIM)
    assert [isinstance(model.blocks[str(index)].mlp, MoEFeedForward) for index in range(3)] == [False, True, True]
    assert total_parameters(cfg) == model.num_params()
    moe_block_experts = 3 * EXPERTS * 32 * DIM
    assert total_parameters(cfg) - active_parameters(cfg) == 2 * moe_block_experts * (EXPERTS - TOP_K) // EXPERTS
