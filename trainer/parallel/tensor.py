"""Tensor parallelism with sequence parallel and loss parallel, as DTensor plans on the model's layers."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trainer.model import Block, Transformer
from trainer.moe import MoEFeedForward

from .moe_tensor import apply_moe_tensor_parallel


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool):
    """Megatron-style: q/k/v and w1 (and SwiGLU's w3) split by output columns, wo and w2 by input rows, so each block
    needs one reduction forward and one backward. With sequence parallel, norms and residuals hold a
    1/tp slice of the sequence and the reductions become reduce-scatter + all-gather pairs. torchao's Float8Linear
    layers (compute.precision fp8) split the same way and cast their local shards (torchao's float8 styles, which
    gather in fp8, need NCCL: gloo has no fp8 collectives)."""
    between_blocks = Shard(1) if sequence_parallel else Replicate()
    top_level = {}
    if model.embedding is not None:
        top_level["embedding"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between_blocks)
    if model.norm is not None and sequence_parallel:
        top_level["norm"] = SequenceParallel()
    if model.output is not None:
        top_level["output"] = ColwiseParallel(
            input_layouts=between_blocks,
            # Loss parallel keeps logits sharded over the vocabulary; the loss reduces across shards.
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    parallelize_module(model, tp_mesh, top_level)
    # Each plan made the shared matrix a DTensor of its own: Shard(0) over the vocabulary both times.
    model.tie_output()
    for block in model.blocks.values():
        plan = {
            "attention": PrepareModuleInput(
                input_layouts=(between_blocks, None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=between_blocks),
        }
        if isinstance(block.mlp, MoEFeedForward):
            apply_moe_tensor_parallel(block.mlp, tp_mesh, between_blocks)
            if block.mlp.shared is not None:
                # Within the block, which takes and returns the rank's part of the sequence.
                plan |= feed_forward_plan("mlp.shared", block.mlp.shared, Shard(1))
        else:
            plan |= feed_forward_plan("mlp", block.mlp, between_blocks)
        if sequence_parallel:
            plan |= {name: SequenceParallel() for name in block_norms(block)}
        parallelize_module(block, tp_mesh, plan)
    if not sequence_parallel:
        norms = [getattr(block, name) for block in model.blocks.values() for name in block_norms(block)]
        for norm in norms + ([model.norm] if model.norm is not None else []):
            replicate_on(norm, tp_mesh)


def block_norms(block: Block) -> list[str]:
    """The block's norms by name: a parallel block's one norm feeds attention and the MLP both, each of whose plans
    gathers its output (under sequence parallelism, once for each)."""
    return ["attention_norm"] + (["mlp_norm"] if block.mlp_norm is not None else [])


def feed_forward_plan(name: str, feed_forward: nn.Module, between: Placement) -> dict:
    """A dense feed-forward block's plan (a block's, or a mixture of experts' shared expert): its input gathered, w1
    (and SwiGLU's w3) split by columns, w2 by rows, its output as `between`."""
    plan = {
        name: PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        f"{name}.w1": ColwiseParallel(),
        f"{name}.w2": RowwiseParallel(output_layouts=between),
    }
    if hasattr(feed_forward, "w3"):
        plan[f"{name}.w3"] = ColwiseParallel()
    return plan


def replicate_on(module: nn.Module, mesh: DeviceMesh) -> None:
    """Run a module on full (replicated) activations with its parameters as Replicate DTensors, so
    every parameter of a tensor-parallel model is a DTensor on the same mesh (grad clipping, FSDP)."""
    distribute_module(
        module,
        mesh,
        input_fn=lambda _module, inputs, device_mesh: tuple(
            DTensor.from_local(tensor, device_mesh, [Replicate()], run_check=False) for tensor in inputs
        ),
        output_fn=lambda _module, output, _mesh: output.to_local(),
    )
