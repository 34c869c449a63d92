"""The collective recorder: every collective and point-to-point op the training steps issue,
reported as one `comm` event per window of steps (this rank's row of the traffic matrix).

A TorchDispatchMode sees each op this thread dispatches, including the ones PyTorch issues from
C++ on its behalf: DDP's reducer all-reduces gradient buckets from autograd hooks, FSDP2 gathers
and reduce-scatters through c10d ops, DTensor (TP) redistributes through functional collectives,
and pipeline stages send and receive activations. The ops run untouched; the mode only reads
sizes (numel × element size, never a copy) and the group, and times each op from issue to
completion where the op says when it completed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from trainer.config import TelemetryConfig
from trainer.parallel.mesh import ParallelMesh
from trainer.telemetry import TelemetryClient
from trainer.traffic import KIND_OF_MESH_DIM, CommOp, TrafficRow, group_kind

# These subclasses turn into collectives only once they run their own dispatch: declining them
# lets them do so with the mode still active, so the collectives they issue are seen.
SUBCLASSES_THAT_ISSUE_COLLECTIVES = (DTensor, AsyncCollectiveTensor)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _total_nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(_nbytes(tensor) for tensor in tensors)


def _nested_nbytes(tensor_lists: Sequence[Sequence[torch.Tensor]]) -> int:
    return sum(_total_nbytes(tensors) for tensors in tensor_lists)


@dataclass(frozen=True)
class _Issued:
    """What an op's arguments say: the op's name, its bytes, the group argument and the peer or
    root as a rank of that group."""

    op: str
    nbytes: int
    group: Any
    group_peer: int | None = None


# c10d ops (torch.distributed's eager API, DDP's reducer, FSDP2), by schema position.
C10D_OPS: dict[str, Callable[[tuple], list[_Issued]]] = {
    "allreduce_": lambda a: [_Issued("all_reduce", _total_nbytes(a[0]), a[1])],
    "allreduce_coalesced_": lambda a: [_Issued("all_reduce", _total_nbytes(a[0]), a[1])],
    "_allgather_base_": lambda a: [_Issued("all_gather", _nbytes(a[0]), a[2])],
    "allgather_": lambda a: [_Issued("all_gather", _nested_nbytes(a[0]), a[2])],
    "allgather_coalesced_": lambda a: [_Issued("all_gather", _nested_nbytes(a[0]), a[2])],
    "allgather_into_tensor_coalesced_": lambda a: [_Issued("all_gather", _total_nbytes(a[0]), a[2])],
    "_reduce_scatter_base_": lambda a: [_Issued("reduce_scatter", _nbytes(a[1]), a[2])],
    "reduce_scatter_": lambda a: [_Issued("reduce_scatter", _nested_nbytes(a[1]), a[2])],
    "reduce_scatter_tensor_coalesced_": lambda a: [_Issued("reduce_scatter", _total_nbytes(a[1]), a[2])],
    "alltoall_": lambda a: [_Issued("all_to_all", _total_nbytes(a[1]), a[2])],
    "alltoall_base_": lambda a: [_Issued("all_to_all", _nbytes(a[1]), a[2])],
    "broadcast_": lambda a: [_Issued("broadcast", _total_nbytes(a[0]), a[1], a[2])],
    "reduce_": lambda a: [_Issued("reduce", _total_nbytes(a[0]), a[1], a[3])],
    "gather_": lambda a: [_Issued("gather", _total_nbytes(a[1]), a[2], a[3])],
    "scatter_": lambda a: [_Issued("scatter", _total_nbytes(a[0]), a[2], a[3])],
    "send": lambda a: [_Issued("send", _total_nbytes(a[0]), a[1], a[2])],
    "recv_": lambda a: [_Issued("recv", _total_nbytes(a[0]), a[1], a[2])],
    "recv_any_source_": lambda a: [_Issued("recv", _total_nbytes(a[0]), a[1])],
    "barrier": lambda a: [_Issued("barrier", 0, a[1])],
    "monitored_barrier_": lambda a: [_Issued("barrier", 0, a[1])],
}

# Functional collectives (DTensor, torch.compile), by schema position; they name their group.
FUNCTIONAL_OPS: dict[str, Callable[[tuple], list[_Issued]]] = {
    "all_reduce": lambda a: [_Issued("all_reduce", _nbytes(a[0]), a[2])],
    "all_reduce_": lambda a: [_Issued("all_reduce", _nbytes(a[0]), a[2])],
    "all_reduce_coalesced": lambda a: [_Issued("all_reduce", _total_nbytes(a[0]), a[2])],
    "all_reduce_coalesced_": lambda a: [_Issued("all_reduce", _total_nbytes(a[0]), a[2])],
    "all_gather_into_tensor": lambda a: [_Issued("all_gather", _nbytes(a[0]) * a[1], a[2])],
    "all_gather_into_tensor_out": lambda a: [_Issued("all_gather", _nbytes(a[0]) * a[1], a[2])],
    "all_gather_into_tensor_coalesced": lambda a: [_Issued("all_gather", _total_nbytes(a[0]) * a[1], a[2])],
    "reduce_scatter_tensor": lambda a: [_Issued("reduce_scatter", _nbytes(a[0]), a[3])],
    "reduce_scatter_tensor_out": lambda a: [_Issued("reduce_scatter", _nbytes(a[0]), a[3])],
    "reduce_scatter_tensor_coalesced": lambda a: [_Issued("reduce_scatter", _total_nbytes(a[0]), a[3])],
    "all_to_all_single": lambda a: [_Issued("all_to_all", _nbytes(a[0]), a[3])],
    "broadcast": lambda a: [_Issued("broadcast", _nbytes(a[0]), a[2], a[1])],
    "broadcast_": lambda a: [_Issued("broadcast", _nbytes(a[0]), a[2], a[1])],
    "isend": lambda a: [_Issued("send", _nbytes(a[0]), a[3], a[1])],
    "irecv": lambda a: [_Issued("recv", _nbytes(a[0]), a[3], a[1])],
    "batch_p2p_ops": lambda a: [
        _Issued("send" if kind == "isend" else "recv", _nbytes(tensor), a[4], peer)
        for kind, peer, tensor in zip(a[0], a[1], a[3], strict=True)
    ],
}


def _overloads(namespace: str, readers: dict[str, Callable]) -> dict[torch._ops.OpOverload, Callable]:
    packets = getattr(torch.ops, namespace)
    return {
        getattr(packet, overload): reader
        for name, reader in readers.items()
        for packet in [getattr(packets, name)]
        for overload in packet.overloads()
    }


class _Timing:
    """Issue time and, once the op reports it, completion time (perf_counter seconds)."""

    __slots__ = ("issued_at", "completed_at")

    def __init__(self) -> None:
        self.issued_at = time.perf_counter()
        self.completed_at: float | None = None

    def complete(self, *_: object) -> None:
        self.completed_at = time.perf_counter()

    @property
    def duration_s(self) -> float | None:
        return None if self.completed_at is None else self.completed_at - self.issued_at


class CollectiveCapture(TorchDispatchMode):
    """While entered, keeps every collective and point-to-point op this thread dispatches.

    Other threads (telemetry, heartbeats) are not seen: dispatch modes are thread-local, and the
    autograd engine carries them into its own threads. Ops on fake tensors (tracing, sharding
    propagation) move no data and are not kept.
    """

    def __init__(self) -> None:
        super().__init__()
        self._readers = _overloads("c10d", C10D_OPS) | _overloads("_c10d_functional", FUNCTIONAL_OPS)
        self._wait_tensor = torch.ops._c10d_functional.wait_tensor.default
        # A functional collective completes when its output is waited on.
        self._pending: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._group_ranks: dict[str, tuple[int, ...]] = {}
        self.records: list[tuple[CommOp, _Timing]] = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let torch.compile compile as if the mode were absent (else it falls back to eager);
        compiled code still dispatches its collectives, so they are seen when they run."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if types and any(issubclass(kind, SUBCLASSES_THAT_ISSUE_COLLECTIVES) for kind in types):
            return NotImplemented
        reader = self._readers.get(func)
        if reader is None or types:
            output = func(*args, **kwargs) if kwargs else func(*args)
            if func is self._wait_tensor and not types:
                timing = self._pending.pop(args[0], None)
                if timing is not None:
                    timing.complete()
            return output
        issued = reader(args)
        timing = _Timing()
        output = func(*args, **kwargs) if kwargs else func(*args)
        for op in issued:
            group = self._ranks_of(op.group)
            peer = group[op.group_peer] if op.group_peer is not None else None
            self.records.append((CommOp(op.op, group, op.nbytes, peer), timing))
        self._track_completion(func.namespace, output, timing)
        return output

    def _ranks_of(self, group: Any) -> tuple[int, ...]:
        """Global ranks, in group-rank order, of a ProcessGroup script object or group name."""
        if isinstance(group, str):
            name, process_group = group, None
        else:
            process_group = dist.ProcessGroup.unbox(group)
            name = process_group.group_name
        ranks = self._group_ranks.get(name)
        if ranks is None:
            if process_group is None:
                process_group = _resolve_process_group(name)
            ranks = self._group_ranks[name] = tuple(dist.get_process_group_ranks(process_group))
        return ranks

    def _track_completion(self, namespace: str, output: Any, timing: _Timing) -> None:
        if namespace == "_c10d_functional":
            for tensor in output if isinstance(output, (list, tuple)) else [output]:
                self._pending[tensor] = timing
            return
        work = output[-1] if isinstance(output, tuple) else output
        if not isinstance(work, torch.ScriptObject):
            return
        with contextlib.suppress(RuntimeError):
            # Works without a future (gloo's send and recv) leave the op untimed.
            dist.distributed_c10d.Work.unbox(work).get_future().add_done_callback(timing.complete)

    def take(self) -> list[tuple[CommOp, _Timing]]:
        records, self.records = self.records, []
        return records


class CommRecorder:
    """Records the steps' collectives and emits one `comm` event every window_steps steps."""

    def __init__(self, mesh: ParallelMesh, telemetry: TelemetryClient, window_steps: int):
        self.telemetry = telemetry
        self.window_steps = window_steps
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._mesh_groups = {dim: dist.get_process_group_ranks(mesh[dim].get_group()) for dim in KIND_OF_MESH_DIM}
        self._kinds: dict[tuple[int, ...], str] = {}
        self._capture = CollectiveCapture()
        self._start_window()

    def _start_window(self) -> None:
        self._row = TrafficRow(self.rank, self.world_size)
        self._steps: list[int] = []
        # Issue to completion, summed over the ops that report completion (overlapping ops each
        # count in full): c10d ops whose Work has a future, functional collectives once waited on.
        self._time_s = 0.0

    def recording(self) -> contextlib.AbstractContextManager:
        """Enter around a step's work: its collectives are recorded until step_finished."""
        return self._capture

    def step_finished(self, step: int) -> None:
        """Fold the step's ops into the window (so memory stays one step's worth), and emit a full window."""
        for op, timing in self._capture.take():
            self._row.add(op, self._kind(op.group))
            self._time_s += timing.duration_s or 0.0
        self._steps.append(step)
        if len(self._steps) >= self.window_steps:
            self.flush()

    def flush(self) -> None:
        """Emit the window so far, if it holds any step."""
        if not self._steps:
            return
        first, last = self._steps[0], self._steps[-1]
        self.telemetry.emit("comm", self._row.payload(first, last, round(self._time_s, 6)), step=last)
        self._start_window()

    def _kind(self, group: tuple[int, ...]) -> str:
        kind = self._kinds.get(group)
        if kind is None:
            kind = self._kinds[group] = group_kind(group, self._mesh_groups, self.world_size)
        return kind


class NoCommRecorder:
    """telemetry.comm is off: no dispatch mode is ever entered."""

    def recording(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def step_finished(self, step: int) -> None:
        pass

    def flush(self) -> None:
        pass


def comm_recorder(
    settings: TelemetryConfig, mesh: ParallelMesh, telemetry: TelemetryClient
) -> CommRecorder | NoCommRecorder:
    if not settings.comm:
        return NoCommRecorder()
    return CommRecorder(mesh, telemetry, settings.comm_window_steps)
