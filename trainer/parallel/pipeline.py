"""Pipeline parallelism: the model cut into stages, run by one of PyTorch's schedules by name."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

from trainer.config import V_SCHEDULES, ParallelConfig
from trainer.model import Transformer

from .mesh import ParallelMesh


def stage_indices(parallel: ParallelConfig, pp_rank: int) -> list[int]:
    """The stages a pipeline rank holds: round-robin ("looped": r, r+p, r+2p, …) or, for V
    schedules, r and 2p−1−r, so the first and the last stage sit on the same rank."""
    pp, per_rank = parallel.pp, parallel.stages_per_rank
    if parallel.pp_schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


def layers_of_stage(layers: int, stages: int, stage: int) -> range:
    per_stage = layers // stages
    return range(stage * per_stage, (stage + 1) * per_stage)


def stage_model(model: Transformer, stage: int, stages: int) -> Transformer:
    """A copy of the model holding only this stage's part; its parameters keep their names."""
    part = copy.deepcopy(model)
    keep = {str(index) for index in layers_of_stage(model.cfg.layers, stages, stage)}
    for name in list(part.blocks.keys()):
        if name not in keep:
            del part.blocks[name]
    if stage != 0:
        part.embedding = None
    if stage != stages - 1:
        part.norm = None
        part.output = None
    return part


def split_model(model: Transformer, parallel: ParallelConfig, pp_rank: int) -> list[tuple[int, Transformer]]:
    stages = parallel.pp * parallel.stages_per_rank
    return [(stage, stage_model(model, stage, stages)) for stage in stage_indices(parallel, pp_rank)]


def build_schedule(
    stage_modules: list[tuple[int, torch.nn.Module]],
    parallel: ParallelConfig,
    mesh: ParallelMesh,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
):
    """One PipelineStage per held stage, driven by the named schedule over the "pp" group."""
    total = parallel.pp * parallel.stages_per_rank
    group = mesh["pp"].get_group()
    stages = [PipelineStage(module, index, total, device, group=group) for index, module in stage_modules]
    schedule_class = get_schedule_class(parallel.pp_schedule)
    if issubclass(schedule_class, PipelineScheduleMulti):
        return schedule_class(stages, n_microbatches=parallel.microbatches, loss_fn=loss_fn)
    (stage,) = stages
    return schedule_class(stage, n_microbatches=parallel.microbatches, loss_fn=loss_fn)
