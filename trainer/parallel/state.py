"""Full (unsharded) parameters out of any layout, to compare layouts or inspect a run."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from .apply import ParallelModel
from .mesh import ParallelMesh


def full_parameters(parallel_model: ParallelModel) -> dict[str, torch.Tensor]:
    """Every parameter this rank's stages hold, gathered whole. Collective over the dp/cp/tp groups."""
    options = StateDictOptions(full_state_dict=True)
    merged: dict[str, torch.Tensor] = {}
    for module in parallel_model.state_modules:
        merged.update(
            {name: tensor.detach().cpu() for name, tensor in get_model_state_dict(module, options=options).items()}
        )
    return merged


def dump_full_parameters(parallel_model: ParallelModel, mesh: ParallelMesh, directory: Path) -> None:
    """One file per pipeline rank (pp-<r>.pt), written by the rank at dp = cp = tp = 0."""
    parameters = full_parameters(parallel_model)
    coordinates = mesh.coordinates()
    if all(coordinates[dim] == 0 for dim in ("dp_replicate", "dp_shard", "cp", "tp")):
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(parameters, directory / f"pp-{coordinates['pp']}.pt")
