"""Pipeline parallelism: the model cut into stages, run by one of PyTorch's schedules by name."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    FORWARD,
    RECV_F,
    RESHARD,
    SEND_F,
    UNSHARD,
    PipelineScheduleMulti,
    get_schedule_class,
)

from trainer.config import V_SCHEDULES, ParallelConfig
from trainer.model import Transformer
from trainer.moe import statistics_paused
from trainer.pipeline_split import stage_blocks

from .mesh import ParallelMesh


def stage_indices(parallel: ParallelConfig, pp_rank: int) -> list[int]:
    """The stages a pipeline rank holds: round-robin ("looped": r, r+p, r+2p, …) or, for V
    schedules, r and 2p−1−r, so the first and the last stage sit on the same rank."""
    pp, per_rank = parallel.pp, parallel.stages_per_rank
    if parallel.pp_schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


def stage_model(model: Transformer, stage: int, stages: int) -> Transformer:
    """A copy of the model holding only this stage's part; its parameters keep their names."""
    part = copy.deepcopy(model)
    keep = {str(index) for index in stage_blocks(model.cfg.layers, stages, stage)}
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
    """One PipelineStage per held stage, driven by the named schedule over the "pp" group.

    The schedule sums the microbatches' gradients as they are (scale_grads off): loss_fn scales them itself,
    since PyTorch's own scaling divides all of .grad at the end of each step, and with gradient accumulation
    the schedule runs several times per optimizer step."""
    total = parallel.pp * parallel.stages_per_rank
    group = mesh["pp"].get_group()
    stages = [UncountedInferenceStage(module, index, total, device, group=group) for index, module in stage_modules]
    schedule_class = get_schedule_class(parallel.pp_schedule)
    if issubclass(schedule_class, PipelineScheduleMulti):
        return schedule_class(stages, n_microbatches=parallel.microbatches, loss_fn=loss_fn, scale_grads=False)
    (stage,) = stages
    return schedule_class(stage, n_microbatches=parallel.microbatches, loss_fn=loss_fn, scale_grads=False)


class UncountedInferenceStage(PipelineStage):
    """A PipelineStage whose shape inference (a real forward with gradients, on the first microbatch or on empty
    tensors, before the schedule's first step) leaves the MoE blocks' load statistics alone. The hook is the
    method PyTorch 2.13's schedules call for that inference; the equivalence tests of MoE under PP notice if a
    later PyTorch stops calling it."""

    def _prepare_forward_infra(self, *args, **kwargs):
        with statistics_paused(self.submod):
            return super()._prepare_forward_infra(*args, **kwargs)


FORWARD_ACTIONS = frozenset({FORWARD, SEND_F, RECV_F, UNSHARD, RESHARD})


@contextlib.contextmanager
def forward_only(schedule) -> Iterator[None]:
    """Lets schedule.eval() run forwards only. PyTorch 2.13's eval() works for the one-stage schedules, but the
    multi-stage ones (a runtime that follows a per-rank list of actions) still run their backward actions and
    fail; within this context their lists keep only the forwards and the sends and receives that feed them,
    each rank's in the order the schedule gave it (an overlapped forward-backward keeps its forward)."""
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if order is None:
        yield
        return
    forwards = {}
    for rank, actions in order.items():
        parts = [part for action in actions for part in (action.sub_actions or [action])]
        forwards[rank] = [part for part in parts if part.computation_type in FORWARD_ACTIONS]
    schedule.pipeline_order_with_comms = forwards
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = order


@contextlib.contextmanager
def gradients_reduced(schedule, reduced: bool) -> Iterator[None]:
    """One run of the schedule that reduces the data-parallel gradients at its end (reduced), or only accumulates
    them, as the inner passes of gradient accumulation do. The stages run every backward without FSDP's
    reduce-scatter and do it in their end-of-run action (perform_reduce_grad, which with scale_grads off does
    nothing else); an inner pass leaves that action out, so the last pass reduces the sum of all of them."""
    if reduced:
        yield
        return
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage in stages:
        stage.perform_reduce_grad = _accumulate_only
    try:
        yield
    finally:
        for stage in stages:
            del stage.perform_reduce_grad


def _accumulate_only(grad_scale_factor: int) -> None:
    """A stage's end-of-run gradient reduction, left out in an inner pass of gradient accumulation."""
