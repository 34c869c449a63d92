"""The collective recorder: every collective and point-to-point op the training steps issue,
reported as one `comm` event per window of steps (this rank's row of the traffic matrix).

While a recorder records, a kernel of ours sits in the dispatcher in front of the backend kernel of
each c10d and functional-collective op, and of nothing else: every other op runs as it would
without the recorder, so the cost is a few microseconds per collective. The kernels see the ops
PyTorch issues on the training's behalf from any thread: DDP's reducer all-reduces gradient buckets
from autograd hooks, FSDP2 gathers and reduce-scatters through c10d ops, DTensor (TP) redistributes
through functional collectives, pipeline stages send and receive activations, and compiled code
issues its collectives when it runs. The ops run untouched; a kernel only reads sizes (numel ×
element size, never a copy) and the group, and times each op from issue to completion where the op
says when it completed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils.weak import WeakIdKeyDictionary

from trainer.collective_progress import CollectiveProgress
from trainer.config import TelemetryConfig
from trainer.parallel.mesh import ParallelMesh
from trainer.telemetry import TelemetryClient
from trainer.traffic import KIND_OF_MESH_DIM, CommOp, TrafficRow, group_kind


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
    peer_bytes: tuple[int, ...] | None = None


def _split_bytes(tensor: torch.Tensor, split_sizes: Sequence[int]) -> tuple[int, ...] | None:
    """Bytes of each destination's rows of an all-to-all's input; None for an even split."""
    if not split_sizes or tensor.shape[0] == 0:
        return None
    row_bytes = _nbytes(tensor) // tensor.shape[0]
    return tuple(rows * row_bytes for rows in split_sizes)


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
    "alltoall_base_": lambda a: [_Issued("all_to_all", _nbytes(a[1]), a[2], peer_bytes=_split_bytes(a[1], a[4]))],
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
    "all_to_all_single": lambda a: [_Issued("all_to_all", _nbytes(a[0]), a[3], peer_bytes=_split_bytes(a[0], a[2]))],
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
    """Every overload of the readers' ops that this torch defines: the point-to-point functional ops are newer
    than some torch builds a GPU image carries, and a build without them cannot issue them either."""
    packets = getattr(torch.ops, namespace)
    return {
        getattr(packet, overload): reader
        for name, reader in readers.items()
        if hasattr(packets, name)
        for packet in [getattr(packets, name)]
        for overload in packet.overloads()
    }


READERS = _overloads("c10d", C10D_OPS) | _overloads("_c10d_functional", FUNCTIONAL_OPS)
# A functional collective completes when its output is waited on.
WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
HOOKED_OPS = (*READERS, WAIT_TENSOR)

# BackendSelect comes after autograd, tensor subclasses (DTensor, AsyncCollectiveTensor) and dispatch modes
# (FakeTensorMode) and right before the backend kernel, so a kernel there sees each op once, on plain tensors.
# No hooked op has a kernel of its own at this key (installing checks), and without ours the dispatcher skips it.
HOOK_KEY = "BackendSelect"
_BELOW_HOOK = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
_META = torch._C.DispatchKey.Meta


def hook_installed() -> bool:
    """Whether a CollectiveCapture's kernels are in the dispatcher now."""
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), HOOK_KEY) for op in HOOKED_OPS)


class _Timing:
    """Issue time and, once the op reports it, completion time (perf_counter seconds). An op is in flight
    until it completes or, if its Work never says it has, until the step that issued it has finished."""

    __slots__ = ("issued_at", "completed_at", "in_flight")

    def __init__(self) -> None:
        self.issued_at = time.perf_counter()
        self.completed_at: float | None = None
        self.in_flight = True

    def complete(self, *_: object) -> None:
        self.completed_at = time.perf_counter()
        self.in_flight = False

    def end_untimed(self) -> None:
        """The op's step has finished but its Work never said when the op completed: it stays untimed."""
        self.in_flight = False

    @property
    def duration_s(self) -> float | None:
        return None if self.completed_at is None else self.completed_at - self.issued_at


class _InsideKeptOp(threading.local):
    """Whether this thread is running a kept op's backend kernel."""

    active = False


class CollectiveCapture:
    """While entered, keeps every collective and point-to-point op the process issues, from any thread.

    The first entry installs the kernels; leaving keeps them installed (installing costs about a
    millisecond, too much to pay every step) but keeps nothing more, and remove() takes them out of the
    dispatcher again. Ops on fake or meta tensors (tracing, sharding propagation) move no data and are
    not kept.

    The kernels run on whichever thread issues an op (the training thread, autograd's threads) and
    Work futures complete on the backend's threads, so the kept ops and pending waits change under a
    lock; a timing is written once, by whichever thread completes its op.
    """

    def __init__(self) -> None:
        self._keeping = False
        self._inside_kept_op = _InsideKeptOp()
        self._libraries: list[torch.library.Library] = []
        self._lock = threading.Lock()
        self._records: list[tuple[CommOp, _Timing]] = []
        self._pending_waits: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._group_ranks: dict[str, tuple[int, ...]] = {}
        self._poller = _CompletionPoller()
        self.progress = CollectiveProgress()

    def __enter__(self) -> CollectiveCapture:
        if not self._libraries:
            self._install()
        self._keeping = True
        return self

    def __exit__(self, *_: object) -> None:
        self._keeping = False

    def remove(self) -> None:
        """Take the kernels out: from now on the ops run as if no capture had been installed."""
        self._keeping = False
        for library in self._libraries:
            library._destroy()
        self._libraries = []
        self._poller.stop()

    def take(self) -> list[tuple[CommOp, _Timing]]:
        """The ops kept since the last take; called once the step that issued them has finished."""
        self._poller.step_finished()
        with self._lock:
            records, self._records = self._records, []
        return records

    def _install(self) -> None:
        if hook_installed():
            raise RuntimeError(
                f"a kernel is already registered at {HOOK_KEY} for a collective: another CollectiveCapture "
                "is installed (remove() it first)"
            )
        libraries = {namespace: torch.library.Library(namespace, "IMPL") for namespace in ("c10d", "_c10d_functional")}
        for op, reader in READERS.items():
            libraries[op.namespace].impl(op, self._collective_kernel(op, reader), HOOK_KEY, with_keyset=True)
        libraries[WAIT_TENSOR.namespace].impl(WAIT_TENSOR, self._wait_kernel, HOOK_KEY, with_keyset=True)
        self._libraries = list(libraries.values())

    def _collective_kernel(self, op: torch._ops.OpOverload, reader: Callable[[tuple], list[_Issued]]) -> Callable:
        completes_at_wait = op.namespace == "_c10d_functional"

        def kernel(keyset: torch._C.DispatchKeySet, *args: Any, **kwargs: Any) -> Any:
            # Redispatching below the hook reaches the backend kernel, never this kernel again; a functional
            # collective's backend kernel issues a c10d op, which comes here nested and is the same traffic.
            if not self._keeping or keyset.has(_META) or self._inside_kept_op.active:
                return op.redispatch(keyset & _BELOW_HOOK, *args, **kwargs)
            issued = reader(args)
            timing = _Timing()
            self._inside_kept_op.active = True
            try:
                output = op.redispatch(keyset & _BELOW_HOOK, *args, **kwargs)
            finally:
                self._inside_kept_op.active = False
            self._keep(issued, timing)
            if completes_at_wait:
                self._await_wait(output, timing)
            else:
                _time_work(output, timing, self._poller)
            return output

        return kernel

    def _wait_kernel(self, keyset: torch._C.DispatchKeySet, tensor: torch.Tensor) -> torch.Tensor:
        output = WAIT_TENSOR.redispatch(keyset & _BELOW_HOOK, tensor)
        with self._lock:
            timing = self._pending_waits.pop(tensor, None)
        if timing is not None:
            timing.complete()
        return output

    def _keep(self, issued: list[_Issued], timing: _Timing) -> None:
        records = []
        for op in issued:
            group = self._ranks_of(op.group)
            peer = group[op.group_peer] if op.group_peer is not None else None
            records.append((CommOp(op.op, group, op.nbytes, peer, op.peer_bytes), timing))
            self.progress.issued(op.op, group, peer, timing)
        with self._lock:
            self._records += records

    def _await_wait(self, output: torch.Tensor | list[torch.Tensor], timing: _Timing) -> None:
        with self._lock:
            for tensor in output if isinstance(output, (list, tuple)) else [output]:
                self._pending_waits[tensor] = timing

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


class _CompletionPoller:
    """Completes the timings of ops whose Work has no future (gloo's send and recv) from a thread of its
    own, which asks each pending Work whether it has completed every POLL_S while any is pending; a
    pipeline stage's wait for its neighbour is then measured too. A timing is late by up to POLL_S.

    A Work is watched only until the step that issued it has finished. Some never say they have completed:
    gloo's reduce-scatter returns a Work that does its part of the op inside wait() and never marks itself
    complete, and it holds a copy of the op's input and its output: watched until it completed, every
    reduce-scatter of every FSDP step would stay in memory for the rest of the run."""

    POLL_S = 0.001

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[Any, _Timing]] = []
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def watch(self, work: Any, timing: _Timing) -> None:
        with self._lock:
            self._pending.append((work, timing))
            if self._thread is None:
                self._stopped = False
                self._thread = threading.Thread(target=self._loop, name="comm-completion-poller", daemon=True)
                self._thread.start()
        self._wake.set()

    def poll(self) -> None:
        """Complete every pending timing whose Work has completed."""
        # Under the lock throughout: a Work this thread held outside it would escape step_finished.
        with self._lock:
            self._pending = [(work, timing) for work, timing in self._pending if not _completed(work, timing)]
            if not self._pending:
                self._wake.clear()

    def step_finished(self) -> None:
        """Complete the timings whose Work has completed since the last poll, and let go of every other Work:
        a step's ops are over once it has finished, whether or not their Work says so."""
        with self._lock:
            pending, self._pending = self._pending, []
            self._wake.clear()
        for work, timing in pending:
            if not _completed(work, timing):
                timing.end_untimed()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._thread = None
        self._wake.set()

    def _loop(self) -> None:
        while not self._stopped:
            self._wake.wait()
            self.poll()
            time.sleep(self.POLL_S)


def _completed(work: Any, timing: _Timing) -> bool:
    """Whether the Work has completed, completing its timing if so."""
    if not work.is_completed():
        return False
    timing.complete()
    return True


def _time_work(output: Any, timing: _Timing, poller: _CompletionPoller) -> None:
    """Complete the timing when the c10d op's Work does."""
    work = output[-1] if isinstance(output, tuple) else output
    if not isinstance(work, torch.ScriptObject):
        return
    work = dist.distributed_c10d.Work.unbox(work)
    try:
        work.get_future().add_done_callback(timing.complete)
    except RuntimeError:
        # gloo's send and recv have no future.
        poller.watch(work, timing)


class CommRecorder:
    """Records the steps' collectives and emits one `comm` event every window_steps steps."""

    def __init__(self, mesh: ParallelMesh, telemetry: TelemetryClient, window_steps: int):
        self.telemetry = telemetry
        self.window_steps = window_steps
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        dims = {dim: mesh.dim_mesh(dim) for dim in KIND_OF_MESH_DIM}
        self._mesh_groups = {
            dim: dist.get_process_group_ranks(dim_mesh.get_group()) for dim, dim_mesh in dims.items() if dim_mesh
        }
        self._kinds: dict[tuple[str, tuple[int, ...]], str] = {}
        self._capture = CollectiveCapture()
        self._start_window()

    def _start_window(self) -> None:
        self._row = TrafficRow(self.rank, self.world_size)
        self._steps: list[int] = []
        # Issue to completion, summed over the ops (overlapping ops each count in full): c10d ops when
        # their Work's future completes (or, without one, when the Work says it has), functional
        # collectives once waited on.
        self._time_s = 0.0

    def recording(self) -> contextlib.AbstractContextManager:
        """Enter around a step's work: its collectives are recorded until step_finished. The first
        entry installs the dispatcher kernels; flush() takes them out."""
        return self._capture

    def step_finished(self, step: int) -> float:
        """Fold the step's ops into the window (so memory stays one step's worth), and emit a full window.
        Returns the step's seconds in collectives (issue to completion, summed as the window's time_s)."""
        step_s = 0.0
        for op, timing in self._capture.take():
            self._row.add(op, self._kind(op))
            step_s += timing.duration_s or 0.0
        self._time_s += step_s
        self._steps.append(step)
        if len(self._steps) >= self.window_steps:
            self._emit_window()
        return step_s

    def progress(self) -> dict:
        """This rank's collective progress, for its heartbeats (collective_progress.py)."""
        return self._capture.progress.snapshot()

    def flush(self) -> None:
        """The run's steps are over: remove the dispatcher kernels and emit the window so far, if it holds any step."""
        self._capture.remove()
        self._emit_window()

    def _emit_window(self) -> None:
        if not self._steps:
            return
        first, last = self._steps[0], self._steps[-1]
        self.telemetry.emit("comm", self._row.payload(first, last, round(self._time_s, 6)), step=last)
        self._start_window()

    def _kind(self, op: CommOp) -> str:
        key = (op.op, op.group)
        kind = self._kinds.get(key)
        if kind is None:
            kind = self._kinds[key] = group_kind(op.group, self._mesh_groups, self.world_size, op.op)
        return kind


class NoCommRecorder:
    """telemetry.comm is off: no kernel is ever registered."""

    def recording(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def step_finished(self, step: int) -> None:
        """Nothing is recorded: no collective time to report."""

    def progress(self) -> None:
        """Nothing is counted: heartbeats carry no collective progress."""

    def flush(self) -> None:
        pass


def comm_recorder(
    settings: TelemetryConfig, mesh: ParallelMesh, telemetry: TelemetryClient
) -> CommRecorder | NoCommRecorder:
    if not settings.comm:
        return NoCommRecorder()
    return CommRecorder(mesh, telemetry, settings.comm_window_steps)
