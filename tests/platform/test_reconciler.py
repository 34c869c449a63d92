"""The reconciler against real processes: each pass compares the active attempts with the local backend (a
supervisor's pid and start time in /proc, its exit record) and acts once, however many passes see the same
thing. The launch message goes to whatever `send_launch` the pass is given: here a list, in a deployment the
broker (tests/platform/test_runs_always_end.py covers that with a real Redis)."""

import json
import signal
import subprocess
import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from loom.runs import states
from loom.runs.backends.local import pid_namespace
from loom.runs.backends.local_supervisor import EXIT_RECORD, TORCHRUN_RECORD
from loom.runs.backends.process_tree import started_at
from loom.runs.models import Attempt
from loom.runs.reconciler import reconcile
from loom.runs.restart_policy import CheckpointRef, FailedAttempt, decide
from loom.runs.services import create_run

from .helpers import TINY_CONFIG, BatchSender, claimed_run

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def sleepers():
    started = []

    def start() -> subprocess.Popen:
        process = subprocess.Popen(["sleep", "600"])
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()
        process.wait()


def submitted(owner, tmp_path, process, state=states.RUNNING, config=None) -> Attempt:
    """A claimed attempt handed to the local backend, `process` standing in for its supervisor."""
    run, attempt, _ = claimed_run(owner, config=config)
    work_dir = tmp_path / f"attempt-{attempt.pk}"
    work_dir.mkdir()
    handle = {
        "pid": process.pid,
        "started_at": started_at(process.pid),
        "pid_namespace": pid_namespace(),
        "host": "this-host",
        "work_dir": str(work_dir),
    }
    Attempt.objects.filter(pk=attempt.pk).update(
        state=state, backend="local", backend_handle=handle, work_dir=str(work_dir)
    )
    attempt.refresh_from_db()
    return attempt


def end_with(process: subprocess.Popen, exit_code: int | None, work_dir) -> None:
    """The supervisor records how torchrun ended (None: it died before it could) and exits."""
    if exit_code is not None:
        (work_dir / EXIT_RECORD).write_text(json.dumps({"exit_code": exit_code, "stopped_by_signal": False}))
    process.kill()
    process.wait()


def state_events(attempt: Attempt, state: str) -> int:
    return attempt.run.events.filter(kind="state", attempt=attempt, payload__state=state).count()


def test_a_starting_attempt_the_backend_runs_is_marked_running_with_its_node_once(platform_user, tmp_path, sleepers):
    attempt = submitted(platform_user[0], tmp_path, sleepers(), state=states.STARTING)
    first = reconcile(lambda attempt_id: None)
    second = reconcile(lambda attempt_id: None)
    attempt.refresh_from_db()
    assert (attempt.state, attempt.nodes) == (states.RUNNING, ["this-host"])
    assert first.running == [attempt.pk] and second.running == []
    assert state_events(attempt, states.RUNNING) == 1


def test_an_attempt_whose_supervisor_recorded_success_ends_succeeded_exactly_once(platform_user, tmp_path, sleepers):
    process = sleepers()
    attempt = submitted(platform_user[0], tmp_path, process)
    assert reconcile(lambda attempt_id: None).ended == []
    end_with(process, 0, tmp_path / f"attempt-{attempt.pk}")
    passes = []

    def one_pass():
        passes.append(reconcile(lambda attempt_id: None))
        connection.close()

    # Two reconcilers at once (two monitor workers by mistake) see the same end: one records it.
    threads = [threading.Thread(target=one_pass) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    attempt.refresh_from_db()
    assert (attempt.state, attempt.exit_code) == (states.SUCCEEDED, 0)
    assert sorted(len(done.ended) for done in passes) == [0, 1]
    assert state_events(attempt, states.SUCCEEDED) == 1
    assert attempt.run.attempts.count() == 1


def test_a_supervisor_gone_without_a_record_fails_as_worker_lost_and_restarts_once(platform_user, tmp_path, sleepers):
    process = sleepers()
    attempt = submitted(platform_user[0], tmp_path, process)
    end_with(process, None, tmp_path / f"attempt-{attempt.pk}")
    reconcile(lambda attempt_id: None)
    reconcile(lambda attempt_id: None)
    attempt.refresh_from_db()
    assert (attempt.state, attempt.failure_kind, attempt.retryable) == (states.FAILED, "worker_lost", True)
    assert "supervisor" in attempt.failure_reason
    assert attempt.run.attempts.count() == 2
    assert attempt.restart_decision.startswith("restarted as attempt 2")
    assert attempt.run.alerts.filter(rule="rank_exit").count() == 1


def test_a_failed_exit_is_classified_from_torchruns_logs(platform_user, tmp_path, sleepers):
    process = sleepers()
    attempt = submitted(platform_user[0], tmp_path, process, config={**TINY_CONFIG, "restart": {"max_restarts": 0}})
    work_dir = tmp_path / f"attempt-{attempt.pk}"
    (work_dir / "logs").mkdir()
    (work_dir / "logs" / "launcher.log").write_text(
        "torch.distributed.elastic.multiprocessing.api: failures:\n"
        "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 4242)\n"
    )
    end_with(process, 1, work_dir)
    reconcile(lambda attempt_id: None)
    attempt.refresh_from_db()
    assert (attempt.state, attempt.exit_code, attempt.failure_kind) == (states.FAILED, 1, "killed")
    assert attempt.failure_reason.startswith("torchrun exited with code 1\nrank 1 was killed by SIGKILL")
    assert attempt.restart_decision == "not restarted: 0 of 0 automatic restarts used (restart.max_restarts)"


def test_a_cancel_is_sent_until_the_attempt_is_gone_then_it_ends_cancelled(platform_user, tmp_path, sleepers):
    process = sleepers()
    attempt = submitted(platform_user[0], tmp_path, process)
    Attempt.objects.filter(pk=attempt.pk).update(state=states.CANCELLING, cancel_requested=True)
    done = reconcile(lambda attempt_id: None)
    assert done.cancels_sent == [attempt.pk]
    # SIGTERM reached the "supervisor": sleep dies of it.
    assert process.wait(timeout=10) == -signal.SIGTERM
    reconcile(lambda attempt_id: None)
    attempt.refresh_from_db()
    assert attempt.state == states.CANCELLED and attempt.run.attempts.count() == 1


def test_a_launch_queued_too_long_is_sent_again_once_and_a_broker_failure_is_tried_next_pass(platform_user, settings):
    settings.LOOM_RELAUNCH_AFTER_S = 30
    run = create_run(platform_user[0], "waiting", TINY_CONFIG)
    attempt = run.attempts.get()
    sent = []
    assert reconcile(sent.append).relaunched == [] and sent == []
    long_ago = timezone.now() - timedelta(seconds=60)
    Attempt.objects.filter(pk=attempt.pk).update(launch_sent_at=long_ago)

    def broker_down(attempt_id):
        raise ConnectionError("redis is down")

    assert reconcile(broker_down).relaunched == []
    attempt.refresh_from_db()
    assert attempt.launch_sent_at == long_ago
    assert reconcile(sent.append).relaunched == [attempt.pk]
    assert reconcile(sent.append).relaunched == []
    assert sent == [attempt.pk]


def test_an_attempt_claimed_but_never_submitted_fails_as_worker_lost(platform_user):
    run, attempt, _ = claimed_run(platform_user[0], config={**TINY_CONFIG, "restart": {"max_restarts": 0}})
    reconcile(lambda attempt_id: None)
    attempt.refresh_from_db()
    assert attempt.state == states.STARTING
    Attempt.objects.filter(pk=attempt.pk).update(launch_sent_at=timezone.now() - timedelta(minutes=10))
    reconcile(lambda attempt_id: None)
    attempt.refresh_from_db()
    assert (attempt.state, attempt.failure_kind) == (states.FAILED, "worker_lost")


def test_an_attempt_whose_supervisor_died_runs_while_torchrun_does_and_cancel_stops_torchrun(
    platform_user, tmp_path, sleepers
):
    supervisor = sleepers()
    attempt = submitted(platform_user[0], tmp_path, supervisor)
    work_dir = tmp_path / f"attempt-{attempt.pk}"
    # torchrun, as the supervisor started it: the leader of a session and group of its own.
    torchrun = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        (work_dir / TORCHRUN_RECORD).write_text(
            json.dumps({"pid": torchrun.pid, "started_at": started_at(torchrun.pid)})
        )
        end_with(supervisor, None, work_dir)
        reconcile(lambda attempt_id: None)
        attempt.refresh_from_db()
        assert attempt.state == states.RUNNING
        Attempt.objects.filter(pk=attempt.pk).update(state=states.CANCELLING, cancel_requested=True)
        reconcile(lambda attempt_id: None)
        assert torchrun.wait(timeout=10) == -signal.SIGTERM
        reconcile(lambda attempt_id: None)
        attempt.refresh_from_db()
        assert attempt.state == states.CANCELLED
    finally:
        torchrun.kill()
        torchrun.wait()


def test_an_attempt_whose_exit_nobody_saw_succeeded_when_every_rank_said_it_finished(platform_user, tmp_path, sleepers):
    process = sleepers()
    attempt = submitted(platform_user[0], tmp_path, process)
    sender = BatchSender(attempt)
    for rank in range(2):
        sender.send(rank, {"kind": "state", "time": 1.0, "payload": {"state": "finished"}})
    end_with(process, None, tmp_path / f"attempt-{attempt.pk}")
    reconcile(lambda attempt_id: None)
    attempt.refresh_from_db()
    assert attempt.state == states.SUCCEEDED and attempt.run.attempts.count() == 1
    (end,) = attempt.run.events.filter(kind="state", payload__state=states.SUCCEEDED)
    assert "every rank reported it finished" in end.payload["reason"]


CHECKPOINT = CheckpointRef(id=7, step=30, path="/runs/run-1/attempt-1/checkpoints/step-000030")


def failed_attempt(**changes) -> FailedAttempt:
    facts = dict(
        number=1,
        retryable=True,
        failure_kind="killed",
        failure_reason="torchrun exited with code 1\nrank 1 was killed by SIGKILL",
        max_restarts=3,
        restarts_in_a_row=0,
        later_attempt_exists=False,
        newest_committed=CHECKPOINT,
        restored_from=None,
        configured_resume=None,
    )
    return FailedAttempt(**{**facts, **changes})


def test_the_restart_policy_resumes_from_the_directory_of_the_newest_checkpoint():
    decision = decide(failed_attempt())
    assert decision.restart.resume == "/runs/run-1/attempt-1/checkpoints"
    assert decision.restart.source == CHECKPOINT
    assert decision.restart.note == (
        "automatic restart 1 of 3 after attempt 1 failed (rank 1 was killed by SIGKILL), "
        "from its checkpoints (newest: step 30)"
    )
    assert decision.summary.format(number=2) == "restarted as attempt 2 from its checkpoints (newest: step 30)"


@pytest.mark.parametrize(
    ("changes", "summary"),
    [
        ({"later_attempt_exists": True}, "not restarted: a later attempt exists"),
        (
            {"retryable": False, "failure_kind": "out_of_memory"},
            "not restarted: a failure of kind 'out of memory' would happen again",
        ),
        ({"restarts_in_a_row": 3}, "not restarted: 3 of 3 automatic restarts used (restart.max_restarts)"),
    ],
)
def test_the_restart_policy_says_why_it_does_not_restart(changes, summary):
    decision = decide(failed_attempt(**changes))
    assert decision.restart is None and decision.summary == summary


def test_without_checkpoints_a_restart_starts_where_the_attempt_had_started_or_from_the_start():
    restored = CheckpointRef(id=3, step=10, path="/runs/run-1/attempt-1/checkpoints/step-000010")
    from_restore = decide(failed_attempt(newest_committed=None, restored_from=restored)).restart
    assert (from_restore.resume, from_restore.source) == (restored.path, restored)
    fresh = decide(failed_attempt(newest_committed=None, configured_resume=None)).restart
    assert (fresh.resume, fresh.source, fresh.origin) == (None, None, "from the start: it had committed no checkpoint")
