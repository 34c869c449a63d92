"""Tied embeddings across pipeline stages, as Megatron-LM runs them.

Each stage is a deep copy of the whole model cut down (pipeline.py), so the last stage's output layer holds a copy
of the embedding matrix, equal to stage 0's at the start and a parameter of its own from then on. Both copies get
the sum of their gradients before every optimizer step, so the same updates keep them equal: that sum is the tied
matrix's gradient in a single process. Looped schedules hold stage 0 on pipeline rank 0 and the last stage on rank
pp − 1, which all-reduce it between them; V schedules hold both on rank 0, which adds them up itself."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.config import V_SCHEDULES, ParallelConfig
from trainer.model import Transformer

from .mesh import ParallelMesh


class TiedEmbeddings:
    """This rank's copies of the tied matrix (stage 0's embedding, the last stage's output), and the group that
    sums their gradients where the ranks hold one copy each. Built on every rank alike: with more than two pipeline
    ranks and a looped schedule it creates the groups of the first and the last one, a collective call."""

    def __init__(self, parts: list[tuple[int, Transformer]], parallel: ParallelConfig, mesh: ParallelMesh):
        last_stage = parallel.pp * parallel.stages_per_rank - 1
        self.embedding = next((part.embedding.weight for stage, part in parts if stage == 0), None)
        self.output = next((part.output.weight for stage, part in parts if stage == last_stage), None)
        self.group: dist.ProcessGroup | None = None
        if parallel.pp_schedule not in V_SCHEDULES:
            self.group = pipeline_ends_group(mesh) if parallel.pp > 2 else mesh["pp"].get_group()

    @property
    def copies(self) -> list[nn.Parameter]:
        """The parameters that repeat another's: the output's copy, counted once in the gradient norm."""
        return [self.output] if self.output is not None else []

    def sum_gradients(self) -> None:
        """Give both copies the sum of their gradients: once a step, after its backwards and data-parallel
        reductions. The copies are laid out alike (tensor parallelism splits both over the vocabulary, FSDP
        shards both by rows), so their local gradients add up element by element."""
        held = [parameter for parameter in (self.embedding, self.output) if parameter is not None]
        if len(held) == 2:
            embedding, output = (local_gradient(parameter) for parameter in held)
            embedding.add_(output)
            output.copy_(embedding)
        elif held:
            dist.all_reduce(local_gradient(held[0]), group=self.group)


def local_gradient(parameter: nn.Parameter) -> torch.Tensor:
    """The parameter's gradient as this rank holds it, laid out as the parameter is. A vocabulary-parallel
    embedding's backward leaves the whole gradient on every tensor-parallel rank (Replicate) where FSDP does
    not reduce it into its shard; its rows of it are the same gradient, laid out as the output's."""
    grad = parameter.grad
    if not isinstance(grad, DTensor):
        return grad
    if grad.placements != parameter.placements:
        parameter.grad = grad = grad.redistribute(grad.device_mesh, parameter.placements)
    return grad.to_local()


def pipeline_ends_group(mesh: ParallelMesh) -> dist.ProcessGroup | None:
    """The group of this rank's first and last pipeline ranks (at its coordinates on the other dims), created with
    every other such pair, in the same order on every rank; None on the pipeline ranks between, which hold neither
    copy."""
    pp = mesh.parallel.pp
    columns = mesh.mesh.mesh.reshape(pp, -1).T
    group, _ = dist.new_subgroups_by_enumeration([[int(ranks[0]), int(ranks[-1])] for ranks in columns])
    return group
