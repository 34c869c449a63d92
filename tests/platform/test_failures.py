"""Failure classification from what torchrun leaves in an attempt's work dir (its summary and error.json
files, in the formats torch 2.13's torchrun writes; the end-to-end tests produce them for real)."""

import json

import pytest

from loom.runs.failures import classify, rank_exit_codes
from loom.runs.logs import first_failure, rank_log_files

SUMMARY = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
trainer.train FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_11:25:50
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : {peer_code} (pid: 6935)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_11:25:50
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : {cause_code} (pid: 6936)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 6936
============================================================
"""


def work_dir_with(tmp_path, cause_code, peer_code=-15, errors=()):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "launcher.log").write_text(SUMMARY.format(cause_code=cause_code, peer_code=peer_code))
    for rank, timestamp, message, stack in errors:
        rank_dir = logs / "rdzv" / "attempt_0" / str(rank)
        rank_dir.mkdir(parents=True)
        error = {"message": message, "extraInfo": {"py_callstack": stack, "timestamp": str(timestamp)}}
        (rank_dir / "error.json").write_text(json.dumps({"message": error}))
    return tmp_path


GLOO_LOST = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1428."
# The texts GPU failures print (NCCL's watchdog, the CUDA runtime), as users report them; no GPU here.
NCCL_WATCHDOG = (
    "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5121, OpType=ALLREDUCE, "
    "NumelIn=262144, NumelOut=262144, Timeout(ms)=600000) ran for 600081 milliseconds before timing out."
)
GLOO_TIMEOUT = (
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms "
    "for recv operation to complete"
)
CUDA_ECC = "RuntimeError: CUDA error: uncorrectable ECC error encountered"
CUDA_ILLEGAL = "RuntimeError: CUDA error: an illegal memory access was encountered"
CUDA_OOM_AS_ERROR = "RuntimeError: CUDA error: out of memory"


def test_summary_gives_every_failed_ranks_exit_code(tmp_path):
    work_dir = work_dir_with(tmp_path, cause_code=-9)
    assert rank_exit_codes(work_dir / "logs" / "launcher.log") == {0: -15, 1: -9}


@pytest.mark.parametrize(
    "cause_code, errors, kind, retryable, reason",
    [
        # A rank SIGKILLed (preemption, the kernel's OOM killer, a fault): its peers then lose it.
        (-9, [(0, 100, GLOO_LOST, GLOO_LOST)], "killed", True, "rank 1 was killed by SIGKILL"),
        (-11, [], "segfault", True, "rank 1 crashed with a segmentation fault (SIGSEGV)"),
        # Only a lost peer on record: the cause was elsewhere, so another try may well work.
        (1, [(0, 100, GLOO_LOST, GLOO_LOST)], "lost_peer", True, "rank 0 failed first: RuntimeError"),
        (
            1,
            [(1, 100, "OutOfMemoryError: CUDA out of memory.", "torch.OutOfMemoryError: CUDA out of memory."),
             (0, 101, GLOO_LOST, GLOO_LOST)],
            "out_of_memory", False, "rank 1 failed first: OutOfMemoryError",
        ),
        (
            1,
            [(0, 101, GLOO_LOST, GLOO_LOST), (1, 100, "KeyError: 'wq'", "KeyError: 'wq'")],
            "exception", False, "rank 1 failed first: KeyError: 'wq'",
        ),
        (1, [(1, 100, NCCL_WATCHDOG, NCCL_WATCHDOG)], "collective_timeout", True, "rank 1 failed first: [Rank 1]"),
        (1, [(0, 100, GLOO_TIMEOUT, GLOO_TIMEOUT)], "collective_timeout", True, "rank 0 failed first: RuntimeError"),
        (1, [(1, 100, CUDA_ECC, CUDA_ECC)], "gpu_error", True, "uncorrectable ECC error"),
        (1, [(1, 100, CUDA_ILLEGAL, CUDA_ILLEGAL)], "gpu_error", True, "illegal memory access"),
        (1, [(1, 100, CUDA_OOM_AS_ERROR, CUDA_OOM_AS_ERROR)], "out_of_memory", False, "out of memory"),
        (2, [], "invalid_config", False, "the trainer refused its config or launch"),
        (1, [], "unknown", True, "trainer.train FAILED"),
    ],
)  # fmt: skip
def test_classification(tmp_path, cause_code, errors, kind, retryable, reason):
    failure = classify(work_dir_with(tmp_path, cause_code, errors=errors))
    assert (failure.kind, failure.retryable) == (kind, retryable)
    assert reason in failure.reason


def test_the_implicated_ranks_own_log_decides_when_error_json_says_little(tmp_path):
    # Killed by SIGABRT after the CUDA runtime printed an Xid to the rank's stderr.
    work_dir = work_dir_with(tmp_path, cause_code=-6)
    rank_dir = work_dir / "logs" / "rdzv" / "attempt_0" / "1"
    rank_dir.mkdir(parents=True)
    (rank_dir / "stderr.log").write_text("step 40\nNVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n")
    failure = classify(work_dir)
    assert (failure.kind, failure.rank, failure.retryable) == ("gpu_error", 1, True)
    assert "SIGABRT" in failure.reason and "Xid" in failure.reason
    # Without that line it is a plain kill of rank 1.
    (rank_dir / "stderr.log").write_text("step 40\n")
    assert (classify(work_dir).kind, classify(work_dir).rank) == ("killed", 1)


def test_a_worker_that_shut_down_is_retryable_whatever_the_logs_say(tmp_path):
    failure = classify(work_dir_with(tmp_path, cause_code=2), worker_lost=True)
    assert (failure.kind, failure.retryable) == ("worker_lost", True)


# One node's summary under Slurm, as n2's torchrun wrote it when its local rank 1 (global rank 3) crashed and
# its local rank 0 then lost its peers: the summary names global ranks.
NODE_SUMMARY = """trainer.train FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-26_04:56:52
  host      : {node}
  rank      : {first_rank} (local_rank: 0)
  exitcode  : {peer_code} (pid: 24915)
  error_file: {rank_dir}/0/error.json
  traceback : RuntimeError: Connection closed by peer
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-26_04:56:52
  host      : {node}
  rank      : {cause_rank} (local_rank: 1)
  exitcode  : {cause_code} (pid: 24916)
  error_file: {rank_dir}/1/error.json
  traceback : Traceback (most recent call last):
============================================================
"""
INJECTED = "InjectedFault: injected fault: rank 3 crashes at step 3 (faults.crash_at_step)"


def multi_node_work_dir(tmp_path, ranks_per_node=2, nodes=("n1", "n2"), summaries=None, errors=()):
    """A work dir as the Slurm backend leaves it: logs/<node>/{node.json, launcher.log, <rdzv>/attempt_0/<local
    rank>/}. summaries maps a node to (cause_code, peer_code); errors are (global rank, timestamp, message)."""
    for node_rank, node in enumerate(nodes):
        node_dir = tmp_path / "logs" / node
        rank_dir = node_dir / f"loom-7_{node}rand" / "attempt_0"
        first_rank = node_rank * ranks_per_node
        for local_rank in range(ranks_per_node):
            (rank_dir / str(local_rank)).mkdir(parents=True)
            (rank_dir / str(local_rank) / "stdout.log").write_text(f"stdout of rank {first_rank + local_rank}\n")
            (rank_dir / str(local_rank) / "stderr.log").write_text(f"stderr of rank {first_rank + local_rank}\n")
        info = {"node": node, "node_rank": node_rank, "first_rank": first_rank}
        (node_dir / "node.json").write_text(json.dumps(info))
        cause_code, peer_code = (summaries or {}).get(node, (None, None))
        summary = NODE_SUMMARY.format(
            node=node,
            first_rank=first_rank,
            cause_rank=first_rank + 1,
            cause_code=cause_code,
            peer_code=peer_code,
            rank_dir=rank_dir,
        )
        (node_dir / "launcher.log").write_text(summary if cause_code is not None else "node started\n")
        for rank, timestamp, message in errors:
            if first_rank <= rank < first_rank + ranks_per_node:
                error = {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(timestamp)}}
                (rank_dir / str(rank - first_rank) / "error.json").write_text(json.dumps({"message": error}))
    return tmp_path


def test_a_global_ranks_logs_are_on_its_own_node(tmp_path):
    work_dir = multi_node_work_dir(tmp_path)
    for rank, node, local_rank in [(0, "n1", 0), (1, "n1", 1), (2, "n2", 0), (3, "n2", 1)]:
        files = rank_log_files(work_dir, rank)
        assert [path.name for path in files] == ["stdout.log", "stderr.log"]
        assert all(path.parts[-5] == node and path.parent.name == str(local_rank) for path in files)
        assert files[0].read_text() == f"stdout of rank {rank}\n"
    assert rank_log_files(work_dir, 4) == []


def test_the_first_failure_on_another_node_is_named_by_its_global_rank(tmp_path):
    work_dir = multi_node_work_dir(
        tmp_path, summaries={"n2": (1, 1)}, errors=[(3, 100, INJECTED), (2, 101, GLOO_LOST), (0, 101, GLOO_LOST)]
    )
    assert first_failure(work_dir).rank == 3
    failure = classify(work_dir)
    assert (failure.kind, failure.rank, failure.retryable) == ("exception", 3, False)
    assert "rank 3 failed first: InjectedFault" in failure.reason


def test_every_nodes_summary_gives_exit_codes_by_global_rank(tmp_path):
    # n2's rank 3 was SIGKILLed; n1's torchrun stopped its ranks with SIGTERM when srun ended the step.
    work_dir = multi_node_work_dir(tmp_path, summaries={"n1": (-15, -15), "n2": (-9, -15)})
    failure = classify(work_dir)
    assert (failure.kind, failure.rank) == ("killed", 3)
    assert failure.reason == "rank 3 was killed by SIGKILL"


def test_a_multi_node_failure_without_evidence_shows_every_nodes_launcher_log(tmp_path):
    work_dir = multi_node_work_dir(tmp_path)
    failure = classify(work_dir)
    assert failure.kind == "unknown"
    assert "== n1 ==\nnode started" in failure.reason and "== n2 ==\nnode started" in failure.reason


def test_a_node_json_that_is_not_json_leaves_the_single_torchrun_layout(tmp_path):
    work_dir = work_dir_with(tmp_path, cause_code=1, errors=[(1, 100, INJECTED, INJECTED)])
    (work_dir / "logs" / "rdzv" / "node.json").write_text("half writ")
    stderr = work_dir / "logs" / "rdzv" / "attempt_0" / "1" / "stderr.log"
    stderr.write_text("rank 1 crashed\n")
    assert classify(work_dir).rank == 1
    assert rank_log_files(work_dir, 1) == [stderr]
