"""Runs launched through the platform onto a real three-node Slurm cluster (tests/slurm_cluster.py): every
rank on its node reports, the losses are those of the same layout run locally, Cancel leaves nothing behind on
any node, a killed rank and a lost node both come back by themselves from the last checkpoint."""

import pytest

from loom.runs import states
from loom.runs.models import Attempt, Run
from loom.telemetry.models import RankStatus
from tests.conftest import wait_for

from ..deployment import environment_of
from .helpers import TINY_CONFIG
from .test_launch import api, metric_steps
from .test_rank_environment import PLATFORM_SECRETS

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

# Two nodes of two ranks: tensor parallel inside a node, data parallel across the two.
TWO_NODES = {**TINY_CONFIG, "steps": 12, "parallel": {"dp_replicate": 2, "tp": 2}}
CHECKPOINTED = {**TWO_NODES, "steps": 40, "checkpoint": {"interval_steps": 5}}


def finished(run_id: int, timeout: float = 300) -> Run:
    return wait_for(
        lambda: Run.objects.filter(pk=run_id, state__in=states.TERMINAL).first(), timeout=timeout, message="the run"
    )


def losses(run: Run, attempt_number: int = 1) -> list[float]:
    events = run.events.filter(kind="metric", rank=0, attempt__number=attempt_number).order_by("step")
    return [event.payload["loss_mean"] for event in events]


def test_a_two_node_run_reports_every_rank_from_its_node_and_trains_as_it_does_locally(
    live_platform, platform_user, token_for, settings, slurm_cluster
):
    token = token_for(platform_user[0])
    created = api(f"{live_platform.url}/api/runs", token, "POST", {"name": "on slurm", "config": TWO_NODES})
    attempt = wait_for(
        lambda: Attempt.objects.filter(run_id=created["id"], state=states.RUNNING).exclude(nodes=[]).first(),
        timeout=180,
        message="the job to run",
    )
    assert attempt.backend == "slurm" and len(attempt.nodes) == 2 and set(attempt.nodes) <= set(slurm_cluster.nodes)
    wait_for(lambda: RankStatus.objects.filter(attempt=attempt).count() == 4, timeout=120, message="every rank")
    nodes_page = api(f"{live_platform.url}/api/nodes", token)
    placed = {node["name"]: [run["ranks"] for run in node["runs"]] for node in nodes_page["nodes"]}
    run = finished(created["id"])
    attempt.refresh_from_db()
    assert run.state == states.SUCCEEDED, attempt.failure_reason
    assert attempt.backend_handle["job_id"]
    # Ranks 0 and 1 on the first node, 2 and 3 on the second, as torchrun numbered them by node rank.
    hosts = dict(RankStatus.objects.filter(attempt=attempt).values_list("rank", "host"))
    assert {hosts[0], hosts[2]} == set(attempt.nodes) and hosts[0] == hosts[1] and hosts[2] == hosts[3]
    heatmap = api(f"{live_platform.url}/api/runs/{run.pk}/metrics/heatmap?metric=step_time_s", token)
    assert set(heatmap["hosts"]) == set(attempt.nodes)
    assert {name: sorted(rank for ranks in runs for rank in ranks) for name, runs in placed.items() if runs} == {
        hosts[0]: [0, 1],
        hosts[2]: [2, 3],
    }
    for rank in range(4):
        assert metric_steps(run, rank) == list(range(1, TWO_NODES["steps"] + 1))

    settings.LOOM_BACKEND = "local"
    local = api(f"{live_platform.url}/api/runs", token, "POST", {"name": "locally", "config": TWO_NODES})
    local_run = finished(local["id"])
    assert local_run.state == states.SUCCEEDED
    assert local_run.attempts.get().backend == "local"
    assert losses(run) == pytest.approx(losses(local_run), rel=1e-5)


def test_cancel_stops_the_job_on_every_node(live_platform, platform_user, token_for, slurm_cluster):
    token = token_for(platform_user[0])
    created = api(f"{live_platform.url}/api/runs", token, "POST", {"name": "cancelled", "config": CHECKPOINTED})
    run = Run.objects.get(pk=created["id"])
    wait_for(lambda: 2 in metric_steps(run, 3), timeout=180, message="rank 3's second step")
    attempt = run.attempts.get()
    assert all(slurm_cluster.processes_on(node) for node in attempt.nodes)
    # sbatch ran with the ranks' allow-listed environment: the worker's secrets (the test process holds them)
    # reach no process of the job on any node.
    jobs = [
        (pid, environment)
        for node in attempt.nodes
        for pid in slurm_cluster.processes_on(node)
        if (environment := environment_of(pid)).get("LOOM_ATTEMPT") == str(attempt.pk)
    ]
    assert len(jobs) >= 4, jobs
    for pid, environment in jobs:
        leaked = [name for name in PLATFORM_SECRETS if name in environment]
        assert not leaked, f"process {pid} of the Slurm job started with the platform's {leaked}"
    api(f"{live_platform.url}/api/runs/{run.pk}/cancel", token, "POST", {})
    run = finished(run.pk, timeout=120)
    assert run.state == states.CANCELLED
    wait_for(
        lambda: not any(slurm_cluster.processes_on(node) for node in slurm_cluster.nodes),
        timeout=30,
        message="no process of the job on any node",
    )


def test_a_killed_rank_ends_the_job_on_both_nodes_and_the_restart_resumes(live_platform, platform_user, token_for):
    token = token_for(platform_user[0])
    config = {**CHECKPOINTED, "steps": 16, "faults": {"kill_at_step": 9, "kill_rank": 3}}
    created = api(f"{live_platform.url}/api/runs", token, "POST", {"name": "rank killed", "config": config})
    # The restart is queued in the transaction that ends the first attempt: the run is final only after both.
    run = finished(created["id"], timeout=600)
    assert run.state == states.SUCCEEDED
    first, second = Attempt.objects.filter(run=run).order_by("number")
    assert (first.state, first.failure_kind, first.retryable) == (states.FAILED, "killed", True), first.failure_reason
    assert "rank 3" in first.failure_reason
    assert second.trigger == Attempt.RESTART and second.restored_from is not None
    assert second.restored_from.step == 5
    assert second.backend == "slurm" and len(second.nodes) == 2


def test_a_node_that_loses_its_link_fails_the_attempt_and_the_restart_runs_on_the_others(
    live_platform, platform_user, token_for, slurm_cluster
):
    token = token_for(platform_user[0])
    created = api(f"{live_platform.url}/api/runs", token, "POST", {"name": "node lost", "config": CHECKPOINTED})
    run = Run.objects.get(pk=created["id"])
    wait_for(lambda: 6 in metric_steps(run, 3), timeout=180, message="a checkpoint and a step after it")
    first = run.attempts.get(number=1)
    lost = RankStatus.objects.get(attempt=first, rank=3).host
    slurm_cluster.link_down(lost)
    try:
        wait_for(
            lambda: Attempt.objects.filter(run=run, number=1, state=states.FAILED).exists(),
            timeout=180,
            message="the attempt to fail",
        )
        first.refresh_from_db()
        assert (first.failure_kind, first.retryable) == ("node_failure", True), first.failure_reason
        second = wait_for(lambda: Attempt.objects.filter(run=run, number=2).first(), timeout=30, message="the restart")
        assert second.avoid_nodes == [lost]
        assert f"away from {lost}" in first.restart_decision
        run = finished(run.pk, timeout=420)
        second.refresh_from_db()
        assert run.state == states.SUCCEEDED, second.failure_reason
        assert lost not in second.nodes and len(second.nodes) == 2
        assert second.restored_from is not None and second.restored_from.step >= 5
    finally:
        slurm_cluster.link_up(lost)


def test_a_run_waiting_for_nodes_shows_the_schedulers_reason_and_starts_when_they_free(
    live_platform, platform_user, token_for
):
    token = token_for(platform_user[0])
    first = api(f"{live_platform.url}/api/runs", token, "POST", {"name": "holds two nodes", "config": CHECKPOINTED})
    wait_for(lambda: 2 in metric_steps(Run.objects.get(pk=first["id"]), 3), timeout=180, message="the first run")
    # Two of the three nodes are taken: a second two-node job waits for resources.
    second = api(f"{live_platform.url}/api/runs", token, "POST", {"name": "waits", "config": TWO_NODES})
    waiting = wait_for(
        lambda: next(
            (a for a in api(f"{live_platform.url}/api/runs/{second['id']}", token)["attempts"] if a["pending_reason"]),
            None,
        ),
        timeout=60,
        message="the second run's pending reason",
    )
    assert (waiting["state"], waiting["pending_reason"], waiting["nodes"]) == (states.STARTING, "Resources", [])
    assert finished(first["id"]).state == states.SUCCEEDED
    second_run = finished(second["id"])
    (attempt,) = api(f"{live_platform.url}/api/runs/{second['id']}", token)["attempts"]
    assert second_run.state == states.SUCCEEDED and attempt["pending_reason"] == "" and len(attempt["nodes"]) == 2
