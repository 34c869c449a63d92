"""Runs always end on the Slurm backend too (issue 21): the same faults as test_runs_always_end.py — the launch
worker killed with SIGKILL mid-run, PostgreSQL restarted mid-run and then Cancel, Redis down when a run is
created — with the deployment launching onto the real Slurm test cluster, one rank on each of two nodes. Nothing
of the run lives in a worker: the job is Slurm's, and the reconciler follows it through squeue."""

import time

import pytest

from ..deployment import Deployment, private_deployment
from .test_runs_always_end import (
    STEPS,
    TRAINING,
    WORLD_SIZE,
    assert_each_happened_once,
    assert_no_process_left,
    attempts_of,
    create_run,
    ended_run,
    mend,
    step_rows,
    times_recorded,
    training_attempt,
)

pytestmark = [pytest.mark.slow, pytest.mark.slurm]


@pytest.fixture(scope="module")
def deployment(slurm_cluster):
    with private_deployment(
        host=slurm_cluster.host_address,
        LOOM_BACKEND="slurm",
        LOOM_SLURM_CONF=str(slurm_cluster.conf),
        LOOM_RANKS_PER_NODE="1",
        LOOM_ALLOWED_HOSTS=f"127.0.0.1,localhost,{slurm_cluster.host_address}",
    ) as running:
        yield running


@pytest.fixture(autouse=True)
def whole_deployment(deployment):
    mend(deployment)
    yield deployment
    mend(deployment)
    deployment.end_every_run()


def on_two_nodes(attempt: dict, deployment: Deployment) -> None:
    (row,) = deployment.rows("SELECT backend, nodes FROM runs_attempt WHERE id = %s", attempt["id"])
    assert row["backend"] == "slurm" and len(row["nodes"]) == WORLD_SIZE, row


def test_a_slurm_run_whose_launch_worker_is_killed_mid_run_trains_to_the_end(deployment, slurm_cluster):
    run_id = create_run(deployment, TRAINING, "slurm: worker killed mid-run")
    attempt = training_attempt(deployment, run_id)
    on_two_nodes(attempt, deployment)

    deployment.kill_worker()

    run = ended_run(deployment, run_id)
    attempts = assert_each_happened_once(deployment, run_id)
    assert run["state"] == "succeeded", attempts
    assert [(a["number"], a["state"], a["exit_code"]) for a in attempts] == [(1, "succeeded", 0)]
    assert step_rows(deployment, attempt["id"]) == dict.fromkeys(range(WORLD_SIZE), STEPS)
    assert_no_process_left(deployment, attempts[0])


def test_a_slurm_run_survives_a_postgres_restart_and_the_next_one_is_cancelled_after_one(deployment, slurm_cluster):
    run_id = create_run(deployment, TRAINING, "slurm: postgres restarted mid-run")
    attempt = training_attempt(deployment, run_id)
    deployment.postgres.restart(down_s=5)
    run = ended_run(deployment, run_id)
    attempts = assert_each_happened_once(deployment, run_id)
    assert run["state"] == "succeeded", attempts
    assert step_rows(deployment, attempt["id"]) == dict.fromkeys(range(WORLD_SIZE), STEPS)

    run_id = create_run(deployment, TRAINING, "slurm: cancelled after a postgres restart")
    attempt = training_attempt(deployment, run_id)
    deployment.postgres.restart(down_s=3)
    answer = None
    for _ in range(60):
        answer = deployment.cancel(run_id)
        if answer.status != 500:
            break
        time.sleep(0.5)
    assert answer.status == 202, answer
    run = ended_run(deployment, run_id, timeout=120)
    attempts = assert_each_happened_once(deployment, run_id)
    assert run["state"] == "cancelled", attempts
    assert times_recorded(deployment, run_id, "cancelling") == 1
    assert_no_process_left(deployment, attempts[0])
    assert not any(slurm_cluster.processes_on(node) for node in slurm_cluster.nodes)


def test_a_slurm_run_created_while_redis_is_down_is_launched_once_when_it_is_back(deployment):
    deployment.redis.stop()
    try:
        answer = deployment.post_run(TRAINING, "slurm: created while redis is down")
        assert answer.status == 201 and answer.body["state"] == "queued", answer
        run_id = answer.body["id"]
        time.sleep(2 * float(deployment.environment["LOOM_RELAUNCH_AFTER_S"]))
        assert [(a["state"], a["claimed"]) for a in attempts_of(deployment, run_id)] == [("queued", False)]
    finally:
        deployment.redis.start()
    training_attempt(deployment, run_id)
    run = ended_run(deployment, run_id)
    attempts = assert_each_happened_once(deployment, run_id)
    assert run["state"] == "succeeded", attempts
    assert [(a["number"], a["state"]) for a in attempts] == [(1, "succeeded")]
