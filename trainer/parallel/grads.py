"""The global gradient norm over every shard and stage, and clipping to it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .mesh import ParallelMesh


def total_grad_norm(parameters: list[torch.nn.Parameter], mesh: ParallelMesh) -> torch.Tensor:
    """sqrt of the sum of squares of every gradient element in the whole model, on every rank.

    Gradients are grouped by how they are laid out (plain, or a DTensor on one mesh with one set of
    placements) so each group needs one reduction, not one per parameter, and nothing leaves the
    device until the caller asks for the value."""
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for parameter in parameters:
        grad = parameter.grad
        if grad is not None:
            layout = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
            groups[layout].append(grad)
    squares = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    if not squares:
        return torch.zeros(())
    total = torch.stack(squares).sum()
    if mesh.parallel.pp > 1:
        # Each pipeline rank holds other layers: their squared norms add up.
        dist.all_reduce(total, group=mesh["pp"].get_group())
    return total.sqrt()


def clip_gradients(
    parameters: list[torch.nn.Parameter], max_norm: float, mesh: ParallelMesh, copies: Sequence[torch.nn.Parameter] = ()
) -> float:
    """Scale every gradient by max_norm / total if the total norm is above max_norm; returns the total. `copies`
    repeat other parameters (a tied embedding's copy on the last pipeline stage): their gradients are scaled too
    but counted once, as the one parameter of a single process."""
    left_out = {id(copy) for copy in copies}
    counted = [parameter for parameter in parameters if id(parameter) not in left_out]
    # The one device-to-host sync of the step: the value is reported anyway.
    total = total_grad_norm(counted, mesh).item()
    if max_norm > 0 and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for parameter in parameters:
            if parameter.grad is not None:
                parameter.grad.mul_(scale)
    return total
