"""The collective recorder: ring byte formulas and matrix assembly (pure), what the capture reads from
each op and how its dispatcher kernels come and go (one in-process rank), and real runs with the recorder on by
default: a pp2×dp2×tp2 matrix, DDP's gradient all-reduce, and switched off."""

import itertools
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.hybrid import WORLD, hybrid_config, kind_of_pair
from trainer.collective_progress import PRUNE_AT, CollectiveProgress
from trainer.comm import (
    CollectiveCapture,
    CommRecorder,
    NoCommRecorder,
    _overloads,
    _Timing,
    comm_recorder,
    hook_installed,
)
from trainer.config import ParallelConfig, TelemetryConfig, parse_config
from trainer.model import Transformer
from trainer.parallel.mesh import ParallelMesh
from trainer.telemetry import TelemetryClient, read_spool
from trainer.traffic import CommOp, TrafficRow, bytes_sent, group_kind, traffic_matrix

from .torchrun import ROOT, run_trainer

# ---------------------------------------------------------------- ring formulas


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        (CommOp("all_reduce", (0, 1, 2, 3), 1000), [(2, 1500)]),
        (CommOp("all_gather", (0, 1, 2, 3), 1000), [(2, 750)]),
        (CommOp("reduce_scatter", (0, 1, 2, 3), 1000), [(2, 750)]),
        (CommOp("all_to_all", (0, 1, 2, 3), 1000), [(0, 250), (2, 250), (3, 250)]),
        # Expert parallelism's dispatch: as many rows to each rank as it holds experts for.
        (CommOp("all_to_all", (0, 1, 2, 3), 1000, peer_bytes=(100, 500, 0, 400)), [(0, 100), (2, 0), (3, 400)]),
        (CommOp("broadcast", (0, 1, 2, 3), 1000, peer=0), [(2, 1000)]),
        (CommOp("broadcast", (0, 1, 2, 3), 1000, peer=2), []),
        (CommOp("reduce", (0, 1, 2, 3), 1000, peer=3), [(2, 1000)]),
        (CommOp("reduce", (0, 1, 2, 3), 1000, peer=1), []),
        (CommOp("gather", (0, 1, 2, 3), 1000, peer=3), [(3, 1000)]),
        (CommOp("scatter", (0, 1, 2, 3), 1000, peer=1), [(0, 1000), (2, 1000), (3, 1000)]),
        (CommOp("scatter", (0, 1, 2, 3), 1000, peer=0), []),
        (CommOp("send", (0, 1, 2, 3), 1000, peer=3), [(3, 1000)]),
        (CommOp("recv", (0, 1, 2, 3), 1000, peer=3), []),
        (CommOp("barrier", (0, 1, 2, 3), 0), []),
    ],
)
def test_bytes_rank_1_sends(op, expected):
    assert bytes_sent(op, rank=1) == expected


def test_the_ring_follows_the_groups_rank_order():
    op = CommOp("all_reduce", (4, 0, 6), 300)
    assert bytes_sent(op, 4) == [(0, 400)]
    assert bytes_sent(op, 0) == [(6, 400)]
    assert bytes_sent(op, 6) == [(4, 400)]


def test_a_two_rank_all_reduce_sends_the_whole_buffer():
    assert bytes_sent(CommOp("all_reduce", (0, 1), 1000), 0) == [(1, 1000)]


def test_nothing_is_sent_alone_or_from_outside_the_group():
    assert bytes_sent(CommOp("all_reduce", (3,), 1000), 3) == []
    assert bytes_sent(CommOp("all_reduce", (0, 1), 1000), 2) == []


def test_an_unknown_op_is_refused():
    with pytest.raises(ValueError, match="unknown op 'allreduce'"):
        CommOp("allreduce", (0, 1), 8)


# ---------------------------------------------------------------- kinds

# Rank 5 of pp 2 × dp_shard 2 × tp 2 (tp innermost): coordinates pp 1, dp 0, tp 1.
MESH_GROUPS_OF_RANK_5 = {
    "tp": [4, 5],
    "cp": [5],
    "pp": [1, 5],
    "dp_shard": [5, 7],
    "dp_replicate": [5],
    "dp": [5, 7],
    "dp_shard_cp": [5, 7],
}


@pytest.mark.parametrize(
    ("group", "kind"),
    [((4, 5), "tp"), ((5, 4), "tp"), ((1, 5), "pp"), ((5, 7), "dp"), (tuple(range(8)), "world"), ((1, 3), "other")],
)
def test_a_group_is_named_by_the_mesh_dim_holding_its_ranks(group, kind):
    assert group_kind(group, MESH_GROUPS_OF_RANK_5, world_size=8) == kind


def test_an_all_to_all_on_the_expert_parallel_group_is_expert_traffic_where_dp_holds_the_same_ranks():
    mesh_groups = {**MESH_GROUPS_OF_RANK_5, "ep": [5, 7]}
    assert group_kind((5, 7), mesh_groups, world_size=8, op="all_to_all") == "ep"
    assert group_kind((5, 7), mesh_groups, world_size=8, op="reduce_scatter") == "dp"
    assert group_kind((5, 7), {"ep": [5, 7]}, world_size=8, op="all_gather") == "ep"


def test_a_group_of_some_of_a_dims_ranks_is_named_by_that_dim():
    # Rank 4 of pp 3 × tp 2: it and the first pipeline rank sum a tied embedding's gradients.
    mesh_groups = {"tp": [4, 5], "pp": [0, 2, 4], "dp": [4]}
    assert group_kind((0, 4), mesh_groups, world_size=6) == "pp"


def test_where_dims_coincide_tp_wins_and_the_world_comes_last():
    mesh_groups = {"tp": [0, 1], "pp": [0], "dp": [0]}
    assert group_kind((0, 1), mesh_groups, world_size=2) == "tp"
    assert group_kind((0, 1), {"dp": [0, 1]}, world_size=2) == "dp"


# ---------------------------------------------------------------- one rank's row, and the matrix


def test_a_row_sums_bytes_and_ops_per_destination_and_kind():
    row = TrafficRow(rank=1, world_size=4)
    row.add(CommOp("all_reduce", (0, 1), 1000), "tp")
    row.add(CommOp("all_reduce", (0, 1), 500), "tp")
    row.add(CommOp("send", (1, 3), 64, peer=3), "pp")
    row.add(CommOp("recv", (1, 3), 64, peer=3), "pp")
    row.add(CommOp("all_reduce", (0, 1, 2, 3), 40), "world")
    assert row.payload(first_step=11, last_step=20, time_s=0.25) == {
        "rank": 1,
        "window": [11, 20],
        "world_size": 4,
        "sends": [[0, 1500, "tp", 2], [2, 60, "world", 1], [3, 64, "pp", 1]],
        "ops": {"all_reduce": 3, "recv": 1, "send": 1},
        "time_s": 0.25,
    }


def test_rows_assemble_into_the_matrix_and_windows_add_up():
    rows = [
        {"rank": 0, "world_size": 3, "sends": [[1, 100, "tp", 2], [2, 7, "world", 1]]},
        {"rank": 1, "world_size": 3, "sends": [[0, 100, "tp", 2]]},
        {"rank": 1, "world_size": 3, "sends": [[0, 50, "tp", 1], [2, 9, "pp", 1]]},
    ]
    matrix = traffic_matrix(rows)
    assert matrix.world_size == 3
    assert matrix.bytes == [[0, 100, 7], [150, 0, 9], [0, 0, 0]]
    assert matrix.by_kind == {
        "tp": [[0, 100, 0], [150, 0, 0], [0, 0, 0]],
        "world": [[0, 0, 7], [0, 0, 0], [0, 0, 0]],
        "pp": [[0, 0, 0], [0, 0, 9], [0, 0, 0]],
    }


def test_rows_of_different_worlds_or_outside_ranks_are_refused():
    with pytest.raises(ValueError, match="disagree on the world size"):
        traffic_matrix([{"rank": 0, "world_size": 2, "sends": []}, {"rank": 0, "world_size": 4, "sends": []}])
    with pytest.raises(ValueError, match="outside a world of 2"):
        traffic_matrix([{"rank": 0, "world_size": 2, "sends": [[2, 8, "tp", 1]]}])


def test_no_rows_make_an_empty_matrix():
    assert traffic_matrix([]).bytes == []


def test_the_traffic_module_loads_without_torch():
    """The platform imports it, and the platform does not load torch."""
    check = "import sys, trainer.traffic; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", check], cwd=ROOT).returncode == 0


# ---------------------------------------------------------------- the capture, on one in-process rank


@pytest.fixture(scope="module")
def one_rank_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture
def capture(one_rank_world):
    capture = CollectiveCapture()
    yield capture
    capture.remove()


def captured(capture: CollectiveCapture, operation) -> list[CommOp]:
    with capture:
        operation()
    return [op for op, _ in capture.take()]


def floats(count: int) -> torch.Tensor:
    return torch.ones(count, dtype=torch.float32)


@pytest.mark.parametrize(
    ("name", "operation", "expected"),
    [
        ("all_reduce", lambda: dist.all_reduce(floats(10)), CommOp("all_reduce", (0,), 40)),
        ("all_gather", lambda: dist.all_gather_single(floats(8), floats(8)), CommOp("all_gather", (0,), 32)),
        ("all_gather list", lambda: dist.all_gather([floats(3)], floats(3)), CommOp("all_gather", (0,), 12)),
        (
            "reduce_scatter",
            lambda: dist.reduce_scatter_single(floats(6), floats(6)),
            CommOp("reduce_scatter", (0,), 24),
        ),
        ("all_to_all", lambda: dist.all_to_all_single(floats(4), floats(4)), CommOp("all_to_all", (0,), 16)),
        ("broadcast", lambda: dist.broadcast(floats(5), src=0), CommOp("broadcast", (0,), 20, peer=0)),
        ("reduce", lambda: dist.reduce(floats(5), dst=0), CommOp("reduce", (0,), 20, peer=0)),
        ("gather", lambda: dist.gather(floats(2), [floats(2)], dst=0), CommOp("gather", (0,), 8, peer=0)),
        ("scatter", lambda: dist.scatter(floats(2), [floats(2)], src=0), CommOp("scatter", (0,), 8, peer=0)),
        ("barrier", lambda: dist.barrier(), CommOp("barrier", (0,), 0)),
        (
            "functional all_reduce",
            lambda: funcol.all_reduce(floats(10), "sum", dist.group.WORLD).wait(),
            CommOp("all_reduce", (0,), 40),
        ),
        (
            "functional all_gather",
            lambda: funcol.all_gather_single(floats(3), 0, dist.group.WORLD).wait(),
            CommOp("all_gather", (0,), 12),
        ),
        (
            "functional reduce_scatter",
            lambda: funcol.reduce_scatter_single(floats(4), "sum", 0, dist.group.WORLD).wait(),
            CommOp("reduce_scatter", (0,), 16),
        ),
        (
            "functional all_to_all",
            lambda: funcol.all_to_all_single(floats(4), None, None, dist.group.WORLD).wait(),
            CommOp("all_to_all", (0,), 16, peer_bytes=(16,)),
        ),
        (
            "functional broadcast",
            lambda: funcol.broadcast(floats(2), 0, dist.group.WORLD).wait(),
            CommOp("broadcast", (0,), 8, peer=0),
        ),
    ],
)
def test_the_capture_reads_op_group_and_bytes(capture, name, operation, expected):
    """Once per op: a functional collective's own c10d op is not counted a second time."""
    assert captured(capture, operation) == [expected]


def test_collectives_are_timed_to_their_completion(capture):
    with capture:
        dist.all_reduce(floats(10))
        funcol.all_reduce(floats(10), "sum", dist.group.WORLD).wait()
    timings = [timing for _, timing in capture.take()]
    assert len(timings) == 2
    assert all(timing.duration_s is not None and timing.duration_s >= 0 for timing in timings)


def test_results_are_untouched(capture):
    tensor = torch.arange(6, dtype=torch.float32)
    with capture:
        dist.all_reduce(tensor)
        gathered = funcol.all_gather_single(tensor, 0, dist.group.WORLD).wait()
    assert torch.equal(tensor, torch.arange(6, dtype=torch.float32))
    assert torch.equal(gathered, tensor)


def test_ops_outside_the_capture_and_on_fake_tensors_are_not_kept(capture):
    with capture:
        pass
    dist.all_reduce(floats(4))
    with capture, FakeTensorMode():
        funcol.wait_tensor(funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD))
    assert capture.take() == []


def test_ops_from_other_threads_are_kept(capture):
    """DDP's reducer all-reduces from autograd's threads; the kernels are not tied to the thread that entered."""
    with capture:
        worker = threading.Thread(target=lambda: dist.all_reduce(floats(3)))
        worker.start()
        worker.join()
    assert [op for op, _ in capture.take()] == [CommOp("all_reduce", (0,), 12)]


def test_compiled_code_runs_and_its_collectives_are_kept(capture):
    @torch.compile(backend="aot_eager", fullgraph=True)
    def reduce_twice(tensor):
        return funcol.all_reduce(tensor * 2, "sum", dist.group.WORLD).wait() + 1

    with capture:
        result = reduce_twice(floats(5))
        reduce_twice(floats(5))
    assert torch.equal(result, torch.full((5,), 3.0))
    assert [op for op, _ in capture.take()] == [CommOp("all_reduce", (0,), 20)] * 2


def test_a_second_capture_is_refused_while_one_is_installed(capture):
    with capture:
        pass
    with pytest.raises(RuntimeError, match="another CollectiveCapture is installed"), CollectiveCapture():
        pass


def test_progress_counts_each_groups_collectives_and_names_the_op_still_in_flight(capture):
    with capture:
        dist.all_reduce(floats(3))
        funcol.all_reduce(floats(3), "sum", dist.group.WORLD).wait()
        unfinished = funcol.all_gather_single(floats(2), 0, dist.group.WORLD)
        in_flight = capture.progress.snapshot()
        unfinished.wait()
    dist.all_reduce(floats(3))
    done = capture.progress.snapshot()
    assert in_flight["groups"] == done["groups"] == [{"ranks": [0], "issued": 3}]
    assert in_flight["waiting"]["op"] == "all_gather" and in_flight["waiting"]["ranks"] == [0]
    assert done["waiting"] is None and done["peers"] == []
    assert 0 <= done["quiet_s"] < 60


def test_a_finished_steps_work_keeps_no_tensor_alive(capture):
    """gloo's reduce-scatter returns a Work that never says it has completed and holds the op's tensors: once
    the step has finished the capture lets go of it, else FSDP's gradient buffers pile up step after step."""
    output = floats(4)
    output_alive = weakref.ref(output)
    with capture:
        dist.reduce_scatter_single(output, floats(4))
    capture.take()
    del output
    assert output_alive() is None


def test_an_op_whose_work_never_says_it_completed_is_in_flight_only_until_its_step_has_finished(capture):
    with capture:
        dist.reduce_scatter_single(floats(4), floats(4))
    during_the_step = capture.progress.snapshot()
    ((op, timing),) = capture.take()
    assert during_the_step["waiting"]["op"] == "reduce_scatter"
    assert capture.progress.snapshot()["waiting"] is None
    assert op == CommOp("reduce_scatter", (0,), 16) and timing.duration_s is None


def test_progress_counts_sends_and_receives_per_peer():
    """Point-to-point ops are counted by their other end, not by group: stages exchange different numbers."""
    progress = CollectiveProgress()
    issued = [("send", 1), ("send", 1), ("recv", 1), ("recv", 3)]
    timings = [_Timing() for _ in issued]
    for (op, peer), timing in zip(issued, timings, strict=True):
        progress.issued(op, (0, 1, 2, 3), peer, timing)
    for timing in timings[:3]:
        timing.complete()
    snapshot = progress.snapshot()
    assert snapshot["peers"] == [{"peer": 1, "sent": 2, "received": 1}, {"peer": 3, "sent": 0, "received": 1}]
    assert snapshot["groups"] == []
    assert snapshot["waiting"]["op"] == "recv" and snapshot["waiting"]["for_s"] >= 0


def test_ops_never_completed_are_not_kept_without_bound():
    """A functional collective whose result is never waited on never completes: the list of ops in flight
    keeps only the newest of them, and counting stays cheap."""
    progress = CollectiveProgress()
    for _ in range(3 * PRUNE_AT):
        progress.issued("all_reduce", (0, 1), None, _Timing())
    assert len(progress._pending) <= PRUNE_AT
    assert progress.snapshot()["groups"] == [{"ranks": [0, 1], "issued": 3 * PRUNE_AT}]


def test_heartbeats_carry_the_collective_progress(one_rank_world, tmp_path):
    recorder, _ = one_rank_recorder(tmp_path / "unused", window_steps=1)
    telemetry = TelemetryClient(None, None, None, 0, tmp_path, flush_interval_s=0.05, heartbeat_interval_s=0.05)
    telemetry.heartbeat_details = recorder.progress
    with recorder.recording():
        dist.all_reduce(floats(2))
        dist.all_reduce(floats(2))
    recorder.flush()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not heartbeat_counts(tmp_path):
        time.sleep(0.05)
    telemetry.close(timeout_s=5)
    assert heartbeat_counts(tmp_path)[-1] == [{"ranks": [0], "issued": 2}]


def heartbeat_counts(spool_dir) -> list[list[dict]]:
    return [
        event["payload"]["collectives"]["groups"]
        for batch in read_spool(spool_dir)
        for event in batch["events"]
        if event["kind"] == "heartbeat" and event["payload"].get("collectives", {}).get("groups")
    ]


def one_rank_recorder(tmp_path, window_steps: int) -> tuple[CommRecorder, TelemetryClient]:
    mesh = ParallelMesh(ParallelConfig(), world_size=1, device_type="cpu")
    telemetry = TelemetryClient(None, None, None, 0, tmp_path, flush_interval_s=0.05, heartbeat_interval_s=None)
    recorder = comm_recorder(TelemetryConfig(comm=True, comm_window_steps=window_steps), mesh, telemetry)
    assert isinstance(recorder, CommRecorder)
    return recorder, telemetry


def comm_events(telemetry: TelemetryClient, spool_dir) -> list[dict]:
    telemetry.close(timeout_s=5)
    return [event for batch in read_spool(spool_dir) for event in batch["events"] if event["kind"] == "comm"]


def test_a_recorder_emits_a_row_per_window_and_the_rest_at_the_end(one_rank_world, tmp_path):
    recorder, telemetry = one_rank_recorder(tmp_path, window_steps=2)
    for step in (1, 2, 3):
        with recorder.recording():
            assert hook_installed()
            dist.all_reduce(floats(4))
        recorder.step_finished(step)
    recorder.flush()
    events = comm_events(telemetry, tmp_path)
    assert [(event["step"], event["payload"]["window"]) for event in events] == [(2, [1, 2]), (3, [3, 3])]
    assert [event["payload"]["ops"] for event in events] == [{"all_reduce": 2}, {"all_reduce": 1}]
    assert all(event["payload"]["sends"] == [] for event in events)


def test_a_flushed_recorder_leaves_no_kernel_and_the_next_one_records_again(one_rank_world, tmp_path):
    first, first_telemetry = one_rank_recorder(tmp_path / "first", window_steps=10)
    with first.recording():
        dist.all_reduce(floats(4))
    first.step_finished(1)
    first.flush()
    assert not hook_installed()
    dist.all_reduce(floats(4))
    first.step_finished(2)
    first.flush()
    assert [event["payload"]["ops"] for event in comm_events(first_telemetry, tmp_path / "first")] == [
        {"all_reduce": 1},
        {},
    ]

    second, second_telemetry = one_rank_recorder(tmp_path / "second", window_steps=10)
    with second.recording():
        dist.all_reduce(floats(4))
    second.step_finished(1)
    second.flush()
    assert not hook_installed()
    assert [event["payload"]["ops"] for event in comm_events(second_telemetry, tmp_path / "second")] == [
        {"all_reduce": 1}
    ]


def test_switched_off_no_kernel_is_registered(one_rank_world):
    mesh = ParallelMesh(ParallelConfig(), world_size=1, device_type="cpu")
    recorder = comm_recorder(TelemetryConfig(comm=False), mesh, telemetry=None)
    assert isinstance(recorder, NoCommRecorder)
    with recorder.recording():
        assert not hook_installed()


# ---------------------------------------------------------------- real runs

HYBRID_RUN = hybrid_config(steps=3, comm_window_steps=3)


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory):
    run = run_trainer(tmp_path_factory.mktemp("hybrid"), HYBRID_RUN, timeout_s=600)
    assert run.returncode == 0, run.failure_report()
    return run


@pytest.fixture(scope="module")
def hybrid_matrix(hybrid_run):
    return traffic_matrix(event["payload"] for _, event in hybrid_run.events("comm"))


@pytest.mark.slow
def test_every_rank_reports_one_window(hybrid_run):
    rows = hybrid_run.events("comm")
    assert sorted(rank for rank, _ in rows) == list(range(WORLD))
    for rank, event in rows:
        assert event["step"] == 3
        assert event["payload"]["rank"] == rank
        assert event["payload"]["window"] == [1, 3]
        assert event["payload"]["world_size"] == WORLD
        assert {"all_gather", "reduce_scatter", "all_reduce", "send", "recv"} <= set(event["payload"]["ops"])


@pytest.mark.slow
def test_each_kind_of_traffic_is_labelled(hybrid_run, hybrid_matrix):
    assert set(hybrid_matrix.by_kind) == {"tp", "dp", "pp", "world"}
    for _, event in hybrid_run.events("comm"):
        assert {kind for _, _, kind, _ in event["payload"]["sends"]} == {"tp", "dp", "pp", "world"}


@pytest.mark.slow
def test_each_kind_flows_only_between_ranks_of_its_group(hybrid_matrix):
    for kind in ("tp", "dp", "pp"):
        for source, destination in itertools.permutations(range(WORLD), 2):
            sent = hybrid_matrix.by_kind[kind][source][destination]
            assert (sent > 0) == (kind_of_pair(source, destination) == kind), (kind, source, destination)


@pytest.mark.slow
def test_tp_pairs_carry_the_most_then_dp_then_pp(hybrid_matrix):
    pairs: dict[str, list[int]] = {"tp": [], "dp": [], "pp": []}
    for source, destination in itertools.permutations(range(WORLD), 2):
        if kind := kind_of_pair(source, destination):
            pairs[kind].append(hybrid_matrix.bytes[source][destination])
    assert min(pairs["tp"]) > max(pairs["dp"]) > 0
    assert min(pairs["dp"]) > max(pairs["pp"]) > 0


@pytest.mark.slow
def test_unrelated_ranks_exchange_only_the_steps_world_all_reduce(hybrid_matrix):
    """The loss/stop all-reduce spans the world, so its ring links each rank to the next one."""
    world = hybrid_matrix.by_kind["world"]
    for source, destination in itertools.permutations(range(WORLD), 2):
        if kind_of_pair(source, destination) is None:
            assert hybrid_matrix.bytes[source][destination] == world[source][destination], (source, destination)
            assert (world[source][destination] > 0) == (destination == (source + 1) % WORLD), (source, destination)


DDP_RUN = {
    "steps": 3,
    "model": {"layers": 2, "dim": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "seq_len": 32},
    "parallel": {"dp_replicate": 2},
    "compute": {"precision": "fp32"},
    "data": {"micro_batch": 4, "corpus_bytes": 200_000},
    "telemetry": {"flush_interval_s": 0.2, "heartbeat_interval_s": 60, "comm_window_steps": 2},
}
# The step's closing all-reduce: loss sum, loss count, stop vote and checkpoint-clock vote in float64.
STEP_ALL_REDUCE_BYTES = 4 * 8


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    run = run_trainer(tmp_path_factory.mktemp("ddp"), DDP_RUN)
    assert run.returncode == 0, run.failure_report()
    return run


@pytest.mark.slow
def test_ddp_gradient_all_reduce_is_recorded(ddp_run):
    """Rank 1 sends its whole gradient (two ranks: 2(n−1)/n = 1) every step, plus the step's all-reduce."""
    gradient_bytes = 4 * Transformer(parse_config(DDP_RUN).model).num_params()
    rows = [event["payload"] for rank, event in ddp_run.events("comm") if rank == 1]
    assert [row["window"] for row in rows] == [[1, 2], [3, 3]]
    for row in rows:
        steps = row["window"][1] - row["window"][0] + 1
        ((destination, sent, kind, ops),) = row["sends"]
        assert (destination, sent, kind) == (0, steps * (gradient_bytes + STEP_ALL_REDUCE_BYTES), "dp")
        # At least one gradient bucket per step, and the step's own all-reduce.
        assert ops == row["ops"]["all_reduce"] >= 2 * steps
        assert row["time_s"] > 0


FSDP_RUN = {
    "steps": 30,
    "model": {"layers": 2, "dim": 128, "heads": 4, "kv_heads": 2, "ffn": 256, "seq_len": 32},
    "parallel": {"dp_shard": 2},
    "compute": {"precision": "fp32"},
    "data": {"micro_batch": 4, "corpus_bytes": 200_000},
    "telemetry": {"flush_interval_s": 0.2, "heartbeat_interval_s": 60, "comm_window_steps": 10},
}
# By this step the allocator and the caches hold what a step needs: RSS grows by 1-2 MiB over the steps after
# it with the recorder off.
WARM_UP_STEP = 10


@pytest.mark.slow
def test_fsdp_memory_stays_flat_with_the_recorder_on(tmp_path):
    """While the recorder held on to gloo's reduce-scatter Works, each FSDP step kept about twice the gradient
    bytes alive (a copy of every reduce-scatter's input and its output) for the rest of the run; growth after
    warm-up must stay under a quarter of that."""
    run = run_trainer(tmp_path, FSDP_RUN)
    assert run.returncode == 0, run.failure_report()
    assert all(event["payload"]["ops"]["reduce_scatter"] > 0 for _, event in run.events("comm"))
    gradient_bytes = 4 * Transformer(parse_config(FSDP_RUN).model).num_params()
    rss = {(rank, event["step"]): event["payload"]["memory_rss"] for rank, event in run.events("metric")}
    last_step = FSDP_RUN["steps"]
    for rank in range(2):
        growth = rss[rank, last_step] - rss[rank, WARM_UP_STEP]
        assert growth < (last_step - WARM_UP_STEP) * gradient_bytes / 2, (rank, growth, gradient_bytes)


@pytest.mark.slow
def test_switched_off_a_run_sends_no_comm_events(tmp_path):
    document = {**DDP_RUN, "steps": 2, "telemetry": {**DDP_RUN["telemetry"], "comm": False}}
    run = run_trainer(tmp_path, document)
    assert run.returncode == 0, run.failure_report()
    assert run.events("comm") == []
    assert len(run.events("metric")) == 2 * 2


def test_ops_this_torch_does_not_define_are_left_out_of_the_hook():
    # The GPU image's torch 2.11 has no _c10d_functional.isend; importing the trainer failed there.
    def reader(args):
        return []

    found = _overloads("_c10d_functional", {"all_reduce": reader, "an_op_no_torch_defines": reader})
    assert found and all(overload.name().startswith("_c10d_functional::all_reduce") for overload in found)
