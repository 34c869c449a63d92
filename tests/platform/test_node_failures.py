"""A node failure, as the lifecycle handles it whatever backend saw it: the restart avoids the nodes the backend
now reports unhealthy, and a node with restart.exclude_after_failures node failures is excluded from every later
launch, with the reason in words (the Nodes page shows it and can include it again)."""

import pytest

from loom.runs import states
from loom.runs.backends import backend_named
from loom.runs.failures import LOST_PEER, NODE_FAILURE, Failure
from loom.runs.launcher import launch_spec
from loom.runs.lifecycle import Ending, end_attempt
from loom.runs.models import Attempt, ExcludedNode

from .helpers import TINY_CONFIG, claimed_run
from .test_nodes import BACKEND

CONFIG = {**TINY_CONFIG, "restart": {"max_restarts": 5, "exclude_after_failures": 2}}


@pytest.fixture(autouse=True)
def three_nodes(settings):
    """n1 mixed, n2 idle, n3 down (tests/platform/test_nodes.py)."""
    settings.LOOM_BACKENDS = {**settings.LOOM_BACKENDS, BACKEND: "tests.platform.test_nodes.ThreeNodeBackend"}


def ran_on(attempt: Attempt, nodes: list[str]) -> Attempt:
    Attempt.objects.filter(pk=attempt.pk).update(
        backend=BACKEND, state=states.RUNNING, nodes=nodes, token_hash=f"claimed-{attempt.pk}"
    )
    attempt.refresh_from_db()
    return attempt


def fail(attempt: Attempt, kind: str) -> None:
    why = "node n3 failed (down: Not responding)" if kind == NODE_FAILURE else "rank 1: connection reset by peer"
    assert end_attempt(attempt.pk, Ending(states.FAILED, reason=why, failure=Failure(kind, why)))


def test_restarts_avoid_a_failed_node_and_it_is_excluded_after_enough_node_failures(platform_user, tmp_path):
    run, first, _ = claimed_run(platform_user[0], config=CONFIG)
    fail(ran_on(first, ["n1", "n3"]), NODE_FAILURE)
    first.refresh_from_db()
    second = run.attempts.get(number=2)
    assert second.avoid_nodes == ["n3"]
    assert first.restart_decision.endswith("away from n3")
    assert not ExcludedNode.objects.exists()
    spec = launch_spec(second, "token", tmp_path, tmp_path / "config.json", backend_named(BACKEND))
    assert spec.exclude == ("n3",)

    # The second node failure on n3: from now on no launch goes there, this run's or any other's.
    fail(ran_on(second, ["n3", "n1"]), NODE_FAILURE)
    (excluded,) = ExcludedNode.objects.all()
    assert (excluded.backend, excluded.name, excluded.excluded_by) == (BACKEND, "n3", None)
    assert excluded.reason.startswith("2 attempts failed on it by node failures")
    other_run, other, _ = claimed_run(platform_user[0], name="another run", config=CONFIG)
    assert launch_spec(other, "token", tmp_path, tmp_path / "config.json", backend_named(BACKEND)).exclude == ("n3",)


def test_a_failure_that_was_not_the_nodes_avoids_no_node(platform_user):
    run, first, _ = claimed_run(platform_user[0], config=CONFIG)
    fail(ran_on(first, ["n1", "n3"]), LOST_PEER)
    assert run.attempts.get(number=2).avoid_nodes == []
    assert not ExcludedNode.objects.exists()
