"""Failure classification from what torchrun leaves in an attempt's work dir (its summary and error.json
files, in the formats torch 2.13's torchrun writes; the end-to-end tests produce them for real)."""

import json

import pytest

from loom.runs.failures import classify, rank_exit_codes

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
