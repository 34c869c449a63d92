"""The vocabulary-parallel chunked cross-entropy on two real ranks (gloo): the same loss on every rank as the
reference over the whole vocabulary, the same gradients once the ranks' shares of the hidden states' gradient are
summed, and no tensor of all the logits, nor of one rank's share of them, on any rank; and the same in loom's
model under tensor and sequence parallelism, where the trainer computes its loss so."""

import copy
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.trainer.test_kernels import LargestTensor, lm_head_inputs
from trainer.config import parse_config
from trainer.kernels import TORCH_KERNELS, kernels_for, logits_steps, reference
from trainer.kernels.vocab_parallel_cross_entropy import vocab_parallel_cross_entropy
from trainer.model import Transformer
from trainer.parallel.local_kernels import on_local_shards
from trainer.parallel.loss import tensor_parallel_cross_entropy
from trainer.parallel.mesh import ParallelMesh
from trainer.parallel.tensor import apply_tensor_parallel

RANKS = 2
CASES = [
    # rows, dim, vocab, chunk_size: a ragged last chunk; one chunk; a chunk larger than the rows.
    (37, 24, 100, 8),
    (64, 16, 258, 64),
    (5, 8, 50, 16),
]


def check_against_the_reference(rank: int, steps, rows: int, dim: int, vocab: int, chunk_size: int) -> None:
    hidden, weight, targets = lm_head_inputs(rows, dim, vocab, torch.device("cpu"))
    # Targets in both ranks' shares and ignored rows: lm_head_inputs ignores every third.
    assert (targets >= vocab // 2).any() and ((targets >= 0) & (targets < vocab // 2)).any()
    expected_hidden, expected_weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    expected = reference.cross_entropy(expected_hidden, expected_weight, targets)
    expected.backward()

    share = vocab // RANKS
    local_weight = weight[rank * share : (rank + 1) * share].clone().requires_grad_()
    local_hidden = hidden.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(
        local_hidden, local_weight, targets, rank * share, dist.group.WORLD, chunk_size=chunk_size, steps=steps
    )
    loss.backward()
    grad_hidden = local_hidden.grad.clone()
    dist.all_reduce(grad_hidden)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_hidden, expected_hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(local_weight.grad, expected_weight.grad[rank * share : (rank + 1) * share])


def check_the_largest_tensor(rank: int, steps) -> None:
    rows, vocab, chunk_size = 192, 1000, 16
    hidden, weight, targets = lm_head_inputs(rows, 8, vocab, torch.device("cpu"))
    share = vocab // RANKS
    local_weight = weight[rank * share : (rank + 1) * share].clone().requires_grad_()
    with LargestTensor() as largest:
        vocab_parallel_cross_entropy(
            hidden.clone().requires_grad_(),
            local_weight,
            targets,
            rank * share,
            dist.group.WORLD,
            chunk_size=chunk_size,
            steps=steps,
        ).backward()
    # One chunk of this rank's logits in fp32 at most: never all rows of its share, let alone the whole vocabulary.
    assert largest.bytes <= chunk_size * share * torch.float32.itemsize < rows * share * torch.float32.itemsize


def check_the_tensor_parallel_model(rank: int) -> None:
    """The model's loss and gradients under tp 2 with sequence parallel, its norms and loss on the local shards as
    trainer/parallel/apply.py sets them up, against the same model in one process."""
    config = parse_config(
        {
            "model": {"layers": 1, "dim": 32, "heads": 4, "kv_heads": 2, "ffn": 64, "vocab": 4096, "seq_len": 64},
            "parallel": {"tp": RANKS},
            "compute": {"precision": "fp32"},
        },
        runnable=False,
    )
    torch.manual_seed(0)
    whole = Transformer(config.model)
    model = copy.deepcopy(whole)
    apply_tensor_parallel(model, ParallelMesh(config.parallel, RANKS, "cpu")["tp"], True, True)
    steps = logits_steps(TORCH_KERNELS)
    model.use_kernels(replace(on_local_shards(TORCH_KERNELS), cross_entropy=tensor_parallel_cross_entropy(steps)))
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.model.vocab, (8, config.model.seq_len), generator=generator)
    targets = torch.randint(0, config.model.vocab, (8, config.model.seq_len), generator=generator)
    with LargestTensor() as largest:
        loss = model(tokens, targets)
        loss.backward()
    expected = whole(tokens, targets)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    # Every gradient, the embedding's (reached through the sequence-parallel norms) and the output's included.
    for name, parameter in model.named_parameters():
        wanted = dict(whole.named_parameters())[name].grad
        torch.testing.assert_close(parameter.grad.full_tensor(), wanted, rtol=1e-4, atol=1e-6, msg=name)
    rows, share = tokens.numel(), config.model.vocab // RANKS
    assert largest.bytes < rows * share * torch.float32.itemsize


def every_check(rank: int, init_file: str, backend: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=RANKS)
    try:
        steps = logits_steps(kernels_for(backend, torch.device("cpu")))
        for case in CASES:
            check_against_the_reference(rank, steps, *case)
        check_the_largest_tensor(rank, steps)
        if backend == "torch":
            check_the_tensor_parallel_model(rank)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_vocab_parallel_cross_entropy_on_two_ranks_is_the_whole_vocabularys(backend, tmp_path):
    mp.spawn(every_check, args=(str(tmp_path / "store"), backend), nprocs=RANKS, join=True)


def test_a_non_negative_ignore_index_is_refused():
    hidden, weight, targets = lm_head_inputs(4, 8, 10, torch.device("cpu"))
    with pytest.raises(ValueError, match="ignore_index must be negative"):
        vocab_parallel_cross_entropy(hidden, weight, targets, 0, None, ignore_index=3)
