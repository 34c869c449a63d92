"""What one block of loom's model keeps for backward, measured: run as a script, it builds the model at one and
at two layers in each layout, runs a forward under saved-tensor hooks and prints, as JSON, the bytes the second
layer added: every storage autograd saved (parameters aside) plus the inputs activation checkpoints hold. In bf16
the forward runs under autocast, as the trainer's does without FSDP; autocast's bf16 copies of the weights are
left out (the planner counts them in a term of their own, for the whole model).

Tensor parallelism runs in one process on a fake process group of two ranks: the collectives move nothing, but
every tensor has the shape, dtype and placement rank 0 of a real run would give it.

    python tests/trainer/saved_activations.py '[[1, false, "none", "fp32"], [2, true, "full", "bf16"]]'
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from trainer.config import RunConfig, parse_config  # noqa: E402
from trainer.kernels import TORCH_KERNELS, kernels_for  # noqa: E402
from trainer.model import Transformer  # noqa: E402
from trainer.parallel.mesh import ParallelMesh  # noqa: E402
from trainer.parallel.recompute import apply_recompute  # noqa: E402
from trainer.parallel.tensor import apply_tensor_parallel  # noqa: E402

# Sizes no activation shares with a weight (tokens 80, not 48, 24 or 136), so a weight copy is told apart by shape.
MODEL = {"dim": 48, "heads": 4, "kv_heads": 2, "ffn": 136, "vocab": 260, "seq_len": 40}
MICRO_BATCH = 2


def layout_config(tp: int, sequence_parallel: bool, recompute: str, precision: str, layers: int) -> RunConfig:
    document = {
        "model": MODEL | {"layers": layers},
        "parallel": {"tp": tp, "sequence_parallel": sequence_parallel},
        "compute": {"precision": precision, "recompute": recompute},
        "data": {"micro_batch": MICRO_BATCH},
    }
    return parse_config(document, runnable=False)


def storage_key(tensor: torch.Tensor) -> tuple[object, int]:
    """A key for the memory a tensor views, and that memory's size. A fake collective's output has no real
    storage: it stands for itself."""
    shard = local(tensor)
    try:
        storage = shard.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except RuntimeError:
        return ("tensor", id(shard)), shard.numel() * shard.element_size()


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def kept_bytes(tp: int, sequence_parallel: bool, recompute: str, precision: str, layers: int) -> int:
    config = layout_config(tp, sequence_parallel, recompute, precision, layers)
    torch.manual_seed(0)
    model = Transformer(config.model)
    if tp > 1:
        # Torch's ops on the DTensor activations: the same ops keep the same tensors on the local rows, where the
        # trainer runs them (trainer/parallel/local_kernels.py); its Triton norm cannot read a fake collective's
        # output, so the planner prices tensor-parallel layouts as these ops (Layout.fused_kernels).
        model.use_kernels(TORCH_KERNELS)
        apply_tensor_parallel(model, ParallelMesh(config.parallel, tp, "cpu")["tp"], sequence_parallel, False)
    else:
        model.use_kernels(kernels_for("triton", torch.device("cpu")))
    apply_recompute(model, config.compute)
    parameters = {storage_key(parameter)[0] for parameter in model.parameters()}
    # A weight's autocast copy, or its transpose as a linear layer saves it.
    weight_shapes = {
        shape for p in model.parameters() for shape in (tuple(local(p).shape), tuple(local(p).shape)[::-1])
    }
    kept: dict[object, int] = {}

    def keep(tensor: torch.Tensor) -> None:
        key, size = storage_key(tensor)
        weight_copy = tensor.dtype == torch.bfloat16 and tuple(local(tensor).shape) in weight_shapes
        if key not in parameters and size and not weight_copy:
            kept[key] = size

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        keep(tensor)
        return tensor

    def checkpoint_inputs(module, args):
        for value in args:
            if isinstance(value, torch.Tensor):
                keep(value)

    for module in model.modules():
        if type(module).__name__ == "CheckpointWrapper":
            module.register_forward_pre_hook(checkpoint_inputs)
    tokens = torch.randint(0, config.model.vocab, (MICRO_BATCH, config.model.seq_len))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast:
        model(tokens)
    return sum(kept.values())


def main(layouts: list[tuple[int, bool, str, str]]) -> dict[str, int]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        return {json.dumps(layout): kept_bytes(*layout, layers=2) - kept_bytes(*layout, layers=1) for layout in layouts}
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    print(json.dumps(main([tuple(layout) for layout in json.loads(sys.argv[1])])))
