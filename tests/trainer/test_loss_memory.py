"""The loss the trainer runs where its chunked kernel does not (tensor parallel without loss parallel): PyTorch's
cross_entropy on the whole logits cast to fp32. Its peak, measured op by op on CPU, is what the planner's logits
term says: 4 bytes per logit of kept log-probabilities plus, in backward, their gradient and the logits' (8 more).
And torchtitan's under tensor parallelism, PyTorch's loss parallel, which holds 4 bytes per logit more."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import Action

from trainer.config import parse_config
from trainer.parallel.apply import cross_entropy
from trainer.plan.layout import Layout
from trainer.plan.memory import logits_term

ROWS, VOCAB, HIDDEN = 512, 8192, 8


def peak_bytes(step) -> int:
    """The most bytes live at once while `step` runs, from the profiler's allocation timeline (torch is pinned)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step()
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            live += size
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return peak


def test_the_unchunked_loss_peaks_where_the_planner_says():
    hidden = torch.randn(ROWS, HIDDEN, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, requires_grad=True)
    targets = torch.randint(0, VOCAB, (1, ROWS))

    def step():
        # The output layer's bf16 logits, released before backward as the trainer's step releases them.
        logits = (hidden.bfloat16() @ weight.bfloat16().T).reshape(1, ROWS, VOCAB)
        loss = cross_entropy(logits, targets)
        del logits
        loss.backward()

    measured = peak_bytes(step) / (ROWS * VOCAB)
    # A tensor-parallel layout without loss parallel computes this loss on the gathered logits of ROWS tokens.
    document = {
        "model": {"layers": 2, "dim": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": VOCAB, "seq_len": ROWS},
        "parallel": {"tp": 2, "loss_parallel": False},
        "compute": {"precision": "bf16"},
        "data": {"micro_batch": 1},
    }
    layout = Layout(parse_config(document, runnable=False))
    assert not layout.fused_loss
    planned = logits_term(layout, held=1).value / (ROWS * VOCAB)
    assert planned == 12
    # What else is live (the output layer's inputs and their gradients) is under 1 % of it.
    assert planned <= measured < planned * 1.01


def test_pytorchs_loss_parallel_peaks_where_the_planner_says(tmp_path):
    """torchtitan's loss under tensor parallelism: PyTorch's loss parallel on vocabulary-sharded DTensor logits, cast
    to fp32. One rank's mesh runs the same ops on its shard as every rank of a wider one."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        hidden = torch.randn(ROWS, HIDDEN, requires_grad=True)
        weight = distribute_tensor(torch.randn(VOCAB, HIDDEN), mesh, [Shard(0)]).detach().requires_grad_()
        targets = torch.randint(0, VOCAB, (ROWS,))

        def step():
            logits = DTensor.from_local(hidden.bfloat16(), mesh, [Replicate()]) @ weight.bfloat16().T
            with loss_parallel():
                loss = F.cross_entropy(logits.float(), targets)
                del logits
                loss.backward()

        measured = peak_bytes(step) / (ROWS * VOCAB)
    finally:
        dist.destroy_process_group()
    document = {
        "model": {"layers": 2, "dim": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": VOCAB, "seq_len": ROWS},
        "parallel": {"tp": 2, "loss_parallel": True},
        "compute": {"precision": "bf16"},
        "data": {"micro_batch": 1},
    }
    layout = Layout(parse_config(document, runnable=False), runtime="torchtitan")
    planned = logits_term(layout, held=1).value / (ROWS * VOCAB / 2)
    # The kept log-probabilities (4 B) and, in backward, three fp32 tensors the logits' size.
    assert planned == 16
    assert planned <= measured < planned * 1.01
