"""What one block of loom's model keeps for backward, measured: run as a script, it builds the model at one and
at two layers in each layout, runs a forward under saved-tensor hooks and prints, as JSON, the bytes the second
layer added: every storage autograd saved (parameters aside) plus the inputs activation checkpoints hold. In bf16
the forward runs under autocast, as the trainer's does without FSDP; autocast's bf16 copies of the weights are
left out (the planner counts them in a term of their own, for the whole model).

The model runs the kernels the trainer would (trainer/parallel/apply.py): the Triton ones (interpreted), under
tensor parallelism on each rank's local rows. Tensor-parallel layouts run on two processes over gloo, and rank 0's
bytes are reported.

A layout is [tp, sequence_parallel, recompute, precision, mlp], where mlp may name a mixture of experts (MIXTURES),
and "parallel_" before it makes the model's blocks parallel ones (model.parallel_blocks):

    python tests/trainer/saved_activations.py \
        '[[2, true, "full", "bf16", "gelu"], [1, false, "none", "fp32", "parallel_moe"]]'
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed._functional_collectives import AsyncCollectiveTensor  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from trainer.config import RunConfig, parse_config  # noqa: E402
from trainer.kernels import kernels_for  # noqa: E402
from trainer.model import Transformer  # noqa: E402
from trainer.parallel.local_kernels import on_local_shards  # noqa: E402
from trainer.parallel.mesh import ParallelMesh  # noqa: E402
from trainer.parallel.moe_tensor import split_expert_columns  # noqa: E402
from trainer.parallel.recompute import apply_recompute  # noqa: E402
from trainer.parallel.tensor import apply_tensor_parallel  # noqa: E402

# Sizes no activation shares with a weight (tokens 80, not 48, 24 or 136), so a weight copy is told apart by shape.
MODEL = {"dim": 48, "heads": 4, "kv_heads": 2, "ffn": 136, "vocab": 260, "seq_len": 40}
MICRO_BATCH = 2
# Mixture-of-experts blocks (SwiGLU experts), by the name a layout gives in place of its mlp.
MIXTURES = {
    "moe": {"experts": 4, "top_k": 2},
    "moe_shared": {"experts": 4, "top_k": 2, "moe": {"shared_expert": True}},
}


PARALLEL_BLOCKS = "parallel_"


def model_variant(mlp: str) -> dict:
    """The model fields a layout's mlp names: the feed-forward block, or a mixture, and whether blocks are parallel."""
    block = mlp.removeprefix(PARALLEL_BLOCKS)
    return MIXTURES.get(block, {"mlp": block}) | {"parallel_blocks": mlp.startswith(PARALLEL_BLOCKS)}


def layout_config(tp: int, sequence_parallel: bool, recompute: str, precision: str, mlp: str, layers: int) -> RunConfig:
    document = {
        "model": MODEL | {"layers": layers} | model_variant(mlp),
        "parallel": {"tp": tp, "sequence_parallel": sequence_parallel},
        "compute": {"precision": precision, "recompute": recompute},
        "data": {"micro_batch": MICRO_BATCH},
    }
    return parse_config(document, runnable=False)


def storage_key(tensor: torch.Tensor) -> tuple[object, int]:
    """A key for the memory a tensor views, and that memory's size (a collective's pending output: its result's)."""
    shard = local(tensor)
    if isinstance(shard, AsyncCollectiveTensor):
        shard = shard.elem
    storage = shard.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def transposed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape[:-2] + shape[-2:][::-1]


def weight_copy_shapes(shape: tuple[int, ...]) -> set[tuple[int, ...]]:
    """The shapes a weight's autocast copy is saved in: as it is, transposed as a linear layer or a grouped product
    saves it, and, of stacked experts, one expert's slice (as a loop over experts saves it)."""
    shapes = {shape, shape[::-1], transposed(shape)}
    if len(shape) == 3:
        shapes |= {shape[1:], shape[1:][::-1]}
    return shapes


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def kept_bytes(tp: int, sequence_parallel: bool, recompute: str, precision: str, mlp: str, layers: int) -> int:
    config = layout_config(tp, sequence_parallel, recompute, precision, mlp, layers)
    torch.manual_seed(0)
    model = Transformer(config.model)
    kernels = kernels_for("triton", torch.device("cpu"))
    if tp > 1:
        model.use_kernels(on_local_shards(kernels))
        tp_mesh = ParallelMesh(config.parallel, tp, "cpu")["tp"]
        apply_tensor_parallel(model, tp_mesh, sequence_parallel, False)
        split_expert_columns(model, tp_mesh)
    else:
        model.use_kernels(kernels)
    apply_recompute(model, config.compute)
    parameters = {storage_key(parameter)[0] for parameter in model.parameters()}
    # A weight's autocast copy, or its transpose as a linear layer (or, of stacked experts, a grouped product) saves it.
    weight_shapes = {shape for p in model.parameters() for shape in weight_copy_shapes(tuple(local(p).shape))}
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


def second_layer_bytes(layouts: list[tuple[int, bool, str, str, str]]) -> dict[str, int]:
    return {json.dumps(layout): kept_bytes(*layout, layers=2) - kept_bytes(*layout, layers=1) for layout in layouts}


def measure_on_a_rank(rank: int, one_rank_layouts: list, layouts: list, store: str, results: str) -> None:
    """This rank's half of the one-rank layouts, then the tensor-parallel ones with the other rank."""
    measured = second_layer_bytes(one_rank_layouts[rank::2])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        tensor_parallel = second_layer_bytes(layouts)
        Path(f"{results}.{rank}").write_text(json.dumps(measured | (tensor_parallel if rank == 0 else {})))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(layouts: list[tuple[int, bool, str, str, str]]) -> dict[str, int]:
    one_rank = [layout for layout in layouts if layout[0] == 1]
    tensor_parallel = [layout for layout in layouts if layout[0] > 1]
    if not tensor_parallel:
        return second_layer_bytes(one_rank)
    if any(layout[0] != 2 for layout in tensor_parallel):
        raise ValueError("tensor-parallel layouts are measured on two ranks: tp must be 2")
    # The two processes the tensor-parallel layouts need share out the one-rank layouts first.
    with tempfile.TemporaryDirectory() as directory:
        store, results = Path(directory, "store"), Path(directory, "results.json")
        mp.spawn(measure_on_a_rank, args=(one_rank, tensor_parallel, str(store), str(results)), nprocs=2)
        return {
            key: value for rank in range(2) for key, value in json.loads(Path(f"{results}.{rank}").read_text()).items()
        }


if __name__ == "__main__":
    print(json.dumps(main([tuple(layout) for layout in json.loads(sys.argv[1])])))
