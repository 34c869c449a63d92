"""Runs always end in their real state, whatever process dies (issue 21): the launch worker killed with
SIGKILL mid-run, PostgreSQL restarted mid-run, Redis down when a run is created.

The platform runs as docker/compose.yaml lays it out, in subprocesses on a PostgreSQL and a Redis of this
module's own (tests/deployment.py); what happened is counted straight from that database, so a duplicate
launch, end or restart fails a test however the platform's own pages would show it."""

import os
import signal
import time
from datetime import datetime
from pathlib import Path

import pytest

from ..deployment import (
    Deployment,
    environment_of,
    private_deployment,
    process_alive,
    wait_until,
)
from .helpers import TINY_CONFIG

pytestmark = pytest.mark.slow

# About 30 s of training for two CPU ranks on two busy cores: long enough to break something mid-run.
STEPS = 1500
TRAINING = {**TINY_CONFIG, "steps": STEPS}
WORLD_SIZE = 2
RUN_END_TIMEOUT_S = 300.0
TERMINAL = ("succeeded", "failed", "cancelled")
EXIT_RECORD = "exit.json"


@pytest.fixture(scope="module")
def deployment():
    with private_deployment() as running:
        yield running


def mend(deployment: Deployment) -> None:
    if not deployment.redis.running:
        deployment.redis.start()
    if not deployment.postgres.running:
        deployment.postgres.start()
    if not deployment.worker.alive:
        deployment.start_worker()


@pytest.fixture(autouse=True)
def whole_deployment(deployment):
    """Each test starts with every piece up and nothing training, whatever the test before it broke or left."""
    mend(deployment)
    yield deployment
    mend(deployment)
    deployment.end_every_run()


def attempts_of(deployment: Deployment, run_id: int) -> list[dict]:
    return deployment.rows(
        "SELECT id, number, state, trigger, exit_code, failure_kind, retryable, restart_decision, backend_handle,"
        " work_dir, token_hash <> '' AS claimed, launch_sent_at, created_at, finished_at, restored_from_id"
        " FROM runs_attempt WHERE run_id = %s ORDER BY number",
        run_id,
    )


def attempt_numbered(deployment: Deployment, run_id: int, number: int) -> dict | None:
    return next((row for row in attempts_of(deployment, run_id) if row["number"] == number), None)


def steps_by_rank(deployment: Deployment, attempt_id: int) -> dict[int, int]:
    rows = deployment.rows(
        "SELECT rank, max(step) AS step FROM telemetry_rankstep WHERE attempt_id = %s GROUP BY rank", attempt_id
    )
    return {row["rank"]: row["step"] for row in rows}


def step_rows(deployment: Deployment, attempt_id: int) -> dict[int, int]:
    rows = deployment.rows(
        "SELECT rank, count(DISTINCT step) AS steps FROM telemetry_rankstep WHERE attempt_id = %s GROUP BY rank",
        attempt_id,
    )
    return {row["rank"]: row["steps"] for row in rows}


def create_run(deployment: Deployment, config: dict, name: str) -> int:
    answer = deployment.post_run(config, name)
    assert answer.status == 201, f"POST /api/runs answered {answer.status}: {answer.body}"
    return answer.body["id"]


def training_attempt(deployment: Deployment, run_id: int, number: int = 1, past_step: int = 20) -> dict:
    """The attempt once it runs and every rank has reported steps past `past_step`."""

    def training():
        attempt = attempt_numbered(deployment, run_id, number)
        if attempt is None or attempt["state"] in TERMINAL:
            assert attempt is None, f"attempt {number} of run {run_id} ended before it trained: {attempt}"
            return None
        steps = steps_by_rank(deployment, attempt["id"])
        if attempt["state"] == "running" and len(steps) == WORLD_SIZE and min(steps.values()) > past_step:
            return attempt
        return None

    return wait_until(training, 180, f"attempt {number} of run {run_id} to run with every rank past step {past_step}")


def ended_run(deployment: Deployment, run_id: int, timeout: float = RUN_END_TIMEOUT_S) -> dict:
    """The run once it reached a final state; on a timeout, the run and the services' logs say where it stuck."""
    try:
        return wait_until(
            lambda: (run := deployment.run(run_id))["state"] in TERMINAL and run, timeout, f"run {run_id} to end"
        )
    except AssertionError as error:
        raise AssertionError(f"{error}\n{deployment.run(run_id)}\n{deployment.log_tails()}") from None


def state_events(deployment: Deployment, run_id: int) -> list[dict]:
    """The state changes the platform (rank null) and the launcher (rank -1) recorded for the run's attempts.
    Events that only tell a pending reason keep the state and are left out."""
    return deployment.rows(
        "SELECT attempt_id, rank, payload->>'state' AS state, count(*) AS times FROM telemetry_event"
        " WHERE run_id = %s AND kind = 'state' AND (rank IS NULL OR rank = -1)"
        " AND NOT payload ? 'pending_reason' GROUP BY attempt_id, rank, payload->>'state'",
        run_id,
    )


def times_recorded(deployment: Deployment, run_id: int, state: str) -> int:
    return sum(event["times"] for event in state_events(deployment, run_id) if event["state"] == state)


def assert_each_happened_once(deployment: Deployment, run_id: int) -> list[dict]:
    """No launch, end, restart or exit alert recorded twice for any attempt of the run; returns the attempts."""
    attempts = attempts_of(deployment, run_id)
    events = state_events(deployment, run_id)
    repeated = [event for event in events if event["times"] > 1]
    assert not repeated, f"a reporter recorded one state of an attempt more than once: {repeated}"

    def times(attempt_id, *wanted):
        return sum(event["times"] for event in events if event["attempt_id"] == attempt_id and event["state"] in wanted)

    for attempt in attempts:
        label = f"attempt {attempt['number']} ({attempt['state']})"
        assert times(attempt["id"], "queued") == 1, f"{label} was queued {times(attempt['id'], 'queued')} times"
        starts = times(attempt["id"], "starting")
        assert starts == (1 if attempt["claimed"] else 0), f"{label} was launched {starts} times"
        ends = times(attempt["id"], *TERMINAL)
        assert ends == (1 if attempt["state"] in TERMINAL else 0), f"{label} has {ends} recorded ends: {events}"
    decided = [attempt for attempt in attempts if attempt["restart_decision"].startswith("restarted as attempt")]
    restarts = [attempt for attempt in attempts if attempt["trigger"] == "restart"]
    assert len(restarts) == len(decided), f"{len(decided)} restart decisions queued {len(restarts)} restarts"
    assert [attempt["number"] for attempt in attempts] == list(range(1, len(attempts) + 1))
    for failed in decided:
        number = failed["number"] + 1
        assert failed["restart_decision"].startswith(f"restarted as attempt {number} "), failed["restart_decision"]
    exits = deployment.rows(
        "SELECT attempt_id, count(*) AS alerts, sum(occurrences) AS occurrences FROM alerts_alert"
        " WHERE run_id = %s AND rule = 'rank_exit' GROUP BY attempt_id",
        run_id,
    )
    twice = [row for row in exits if row["alerts"] > 1 or row["occurrences"] > 1]
    assert not twice, f"an attempt's exit was alerted more than once: {twice}"
    return attempts


def processes_of(deployment: Deployment, attempt: dict) -> list[int]:
    """The attempt's supervisor, torchrun and ranks still running, found by the attempt id in their environment
    and by the backend's handle (a pid with its start time)."""
    found = set(deployment.processes(LOOM_ATTEMPT=str(attempt["id"])))
    handle = attempt["backend_handle"] or {}
    if "pid" in handle and process_alive(handle["pid"], handle.get("started_at")):
        found.add(handle["pid"])
    for pid in torchrun_pids(deployment, attempt["id"]):
        if process_alive(pid) and environment_of(pid).get("LOOM_ATTEMPT") == str(attempt["id"]):
            found.add(pid)
    return sorted(found)


def torchrun_pids(deployment: Deployment, attempt_id: int) -> list[int]:
    rows = deployment.rows(
        "SELECT (payload->>'pid')::int AS pid FROM telemetry_event WHERE attempt_id = %s AND kind = 'state'"
        " AND rank = -1 AND payload ? 'pid'",
        attempt_id,
    )
    return [row["pid"] for row in rows]


def assert_no_process_left(deployment: Deployment, attempt: dict) -> None:
    # The supervisor exits right after it records torchrun's end; give it that moment.
    try:
        wait_until(lambda: not processes_of(deployment, attempt), 30, f"attempt {attempt['number']}'s processes to end")
    except AssertionError:
        left = processes_of(deployment, attempt)
        raise AssertionError(f"processes of attempt {attempt['number']} still run: {left}") from None


def report_end_delay(deployment: Deployment, attempt: dict) -> None:
    """How long after torchrun's end the platform recorded the attempt's end: printed, not asserted (how fast
    two busy cores get there is not what these tests are about)."""
    last_step = deployment.rows("SELECT max(time) AS time FROM telemetry_rankstep WHERE attempt_id = %s", attempt["id"])
    finished: datetime = attempt["finished_at"]
    record = Path(attempt["work_dir"]) / EXIT_RECORD
    parts = [f"attempt {attempt['number']} ended ({attempt['state']})"]
    if last_step and last_step[0]["time"] is not None:
        parts.append(f"{(finished - last_step[0]['time']).total_seconds():.1f} s after its last step")
    if record.exists():
        parts.append(f"{finished.timestamp() - record.stat().st_mtime:+.1f} s from the supervisor's exit record")
    print(", ".join(parts))


def test_a_run_whose_launch_worker_is_killed_mid_run_trains_to_the_end_and_succeeds(deployment):
    run_id = create_run(deployment, TRAINING, "worker killed mid-run")
    attempt = training_attempt(deployment, run_id)

    deployment.kill_worker()

    run = ended_run(deployment, run_id)
    attempts = assert_each_happened_once(deployment, run_id)
    assert [(a["number"], a["state"], a["exit_code"]) for a in attempts] == [(1, "succeeded", 0)], attempts
    assert run["state"] == "succeeded"
    assert step_rows(deployment, attempt["id"]) == dict.fromkeys(range(WORLD_SIZE), STEPS)
    report_end_delay(deployment, attempts[0])
    assert_no_process_left(deployment, attempts[0])


def test_a_rank_killed_while_the_worker_is_dead_fails_as_killed_and_one_restart_runs_once_a_worker_is_back(
    deployment,
):
    config = {**TRAINING, "checkpoint": {"interval_steps": 250}, "faults": {"kill_at_step": 700, "kill_rank": 1}}
    run_id = create_run(deployment, config, "rank killed, worker dead")
    training_attempt(deployment, run_id)

    deployment.kill_worker()

    first = wait_until(
        lambda: (attempt := attempt_numbered(deployment, run_id, 1))["state"] in TERMINAL and attempt,
        RUN_END_TIMEOUT_S,
        "attempt 1 to end",
    )
    assert (first["state"], first["failure_kind"], first["retryable"]) == ("failed", "killed", True), first
    report_end_delay(deployment, first)
    restart = attempt_numbered(deployment, run_id, 2)
    assert restart is not None and restart["trigger"] == "restart", attempts_of(deployment, run_id)
    # With no worker to take it, the reconciler sends the restart's launch again (its outbox) and nothing else.
    wait_until(
        lambda: (attempt_numbered(deployment, run_id, 2)["launch_sent_at"] - restart["created_at"]).total_seconds() > 1,
        60,
        "the reconciler to send the restart's launch again",
    )
    waiting = attempts_of(deployment, run_id)
    assert [(a["number"], a["state"], a["claimed"]) for a in waiting] == [(1, "failed", True), (2, "queued", False)]

    deployment.start_worker()

    run = ended_run(deployment, run_id)
    attempts = assert_each_happened_once(deployment, run_id)
    assert run["state"] == "succeeded", attempts
    assert [(a["number"], a["state"]) for a in attempts] == [(1, "failed"), (2, "succeeded")]
    assert attempts[1]["restored_from_id"] is not None, "the restart did not resume from a committed checkpoint"
    for attempt in attempts:
        assert_no_process_left(deployment, attempt)


def test_a_postgres_restart_mid_run_leaves_the_run_to_succeed_with_every_step_and_no_process_behind(deployment):
    run_id = create_run(deployment, TRAINING, "postgres restarted mid-run")
    attempt = training_attempt(deployment, run_id)

    deployment.postgres.restart(down_s=5)

    run = ended_run(deployment, run_id)
    attempts = assert_each_happened_once(deployment, run_id)
    assert run["state"] == "succeeded", attempts
    assert [(a["number"], a["state"], a["exit_code"]) for a in attempts] == [(1, "succeeded", 0)]
    report_end_delay(deployment, attempts[0])
    assert_no_process_left(deployment, attempts[0])
    # Ranks spool what the platform could not take and send it later: nothing is lost (DESIGN.md, ingest).
    assert step_rows(deployment, attempt["id"]) == dict.fromkeys(range(WORLD_SIZE), STEPS)


def test_a_run_that_finishes_while_postgres_is_down_succeeds_once_it_is_back_with_every_step(deployment):
    run_id = create_run(deployment, TRAINING, "finished while postgres is down")
    attempt = training_attempt(deployment, run_id, past_step=STEPS - 200)
    supervisor = attempt["backend_handle"]["pid"]
    torchrun_and_ranks = [pid for pid in processes_of(deployment, attempt) if pid != supervisor]

    deployment.postgres.stop()
    try:
        # Ranks give up delivering their last telemetry after a while and exit; their spools stay behind.
        wait_until(
            lambda: not any(process_alive(pid) for pid in torchrun_and_ranks), 120, "torchrun and its ranks to exit"
        )
    finally:
        deployment.postgres.start()

    run = ended_run(deployment, run_id)
    attempts = assert_each_happened_once(deployment, run_id)
    assert run["state"] == "succeeded", attempts
    assert [(a["number"], a["state"], a["exit_code"]) for a in attempts] == [(1, "succeeded", 0)]
    report_end_delay(deployment, attempts[0])
    assert step_rows(deployment, attempt["id"]) == dict.fromkeys(range(WORLD_SIZE), STEPS)
    assert_no_process_left(deployment, attempts[0])


def test_cancel_after_a_postgres_restart_mid_run_ends_cancelled_and_stops_every_process(deployment):
    run_id = create_run(deployment, TRAINING, "cancelled after a postgres restart")
    attempt = training_attempt(deployment, run_id)
    assert processes_of(deployment, attempt), "the running attempt's processes were not found"

    deployment.postgres.restart(down_s=3)
    answer = wait_until(
        lambda: (answer := deployment.cancel(run_id)).status != 500 and answer, 30, "a cancel the platform answers"
    )
    assert answer.status == 202, answer

    run = ended_run(deployment, run_id, timeout=120)
    attempts = assert_each_happened_once(deployment, run_id)
    assert run["state"] == "cancelled", attempts
    assert [(a["number"], a["state"]) for a in attempts] == [(1, "cancelled")]
    assert times_recorded(deployment, run_id, "cancelling") == 1
    assert_no_process_left(deployment, attempts[0])


def test_a_run_created_while_redis_is_down_is_queued_and_launched_once_when_redis_is_back(deployment):
    deployment.redis.stop()
    try:
        answer = deployment.post_run(TRAINING, "created while redis is down")
        assert answer.status == 201, answer
        assert answer.body["state"] == "queued", answer.body
        run_id = answer.body["id"]
        # Longer than the reconciler waits before sending a launch again: every send so far found no broker.
        time.sleep(2 * float(deployment.environment["LOOM_RELAUNCH_AFTER_S"]))
        assert [(a["state"], a["claimed"]) for a in attempts_of(deployment, run_id)] == [("queued", False)]
    finally:
        deployment.redis.start()

    attempt = training_attempt(deployment, run_id)
    run = ended_run(deployment, run_id)
    attempts = assert_each_happened_once(deployment, run_id)
    assert run["state"] == "succeeded", attempts
    assert [(a["number"], a["state"], a["exit_code"]) for a in attempts] == [(1, "succeeded", 0)]
    assert step_rows(deployment, attempt["id"]) == dict.fromkeys(range(WORLD_SIZE), STEPS)
    assert_no_process_left(deployment, attempts[0])


def test_an_attempt_whose_supervisor_is_killed_does_not_end_while_its_ranks_still_train(deployment):
    """A supervisor can die too (the OOM killer, a person's kill): the attempt's torchrun, in a session of its
    own, trains on, and the attempt is not over before it is."""
    run_id = create_run(deployment, TRAINING, "supervisor killed mid-run")
    attempt = training_attempt(deployment, run_id)
    supervisor = attempt["backend_handle"]["pid"]
    ranks = [pid for pid in processes_of(deployment, attempt) if pid != supervisor]
    assert ranks, "the running attempt's torchrun and ranks were not found"

    os.kill(supervisor, signal.SIGKILL)

    ended = wait_until(
        lambda: (row := attempt_numbered(deployment, run_id, 1))["state"] in TERMINAL and row,
        RUN_END_TIMEOUT_S,
        "attempt 1 to end",
    )
    still_training = [pid for pid in ranks if process_alive(pid)]
    assert not still_training, (
        f"attempt 1 was recorded {ended['state']} ({ended['failure_kind']}) while its torchrun and ranks "
        f"{still_training} still trained"
    )
    run = ended_run(deployment, run_id)
    attempts = assert_each_happened_once(deployment, run_id)
    assert run["state"] == "succeeded", attempts
    for each in attempts:
        assert_no_process_left(deployment, each)
