"""Nodes: what each node runs for whom (a user's own runs by name, everyone else's as counts), failures per
node, and excluding a node from the next launches, through the services, the API and the page."""

import json
import os
import socket

import pytest

from loom.runs import nodes, states
from loom.runs.backends import NodeInfo, backend_named, current_backend
from loom.runs.models import Attempt, ExcludedNode
from loom.runs.services import create_run
from loom.telemetry.models import RankStatus

from .helpers import TINY_CONFIG, NodeListingBackend

pytestmark = pytest.mark.django_db

BACKEND = "nodes-test"


class ThreeNodeBackend(NodeListingBackend):
    name = BACKEND
    listed = (
        NodeInfo("n1", "mixed", cpus=16, gpus=2),
        NodeInfo("n2", "idle", cpus=16, gpus=2),
        NodeInfo("n3", "down", cpus=8, gpus=0, reason="Not responding"),
    )


class UnreachableBackend(ThreeNodeBackend):
    """A backend whose controller does not answer, as Slurm's backend raises when sinfo fails."""

    name = "nodes-down"

    def nodes(self):
        raise RuntimeError("sinfo failed (1): Unable to contact slurm controller (connect failure)")


def use_three_node_backend(settings):
    """Make ThreeNodeBackend the one new attempts launch onto, for one test (pytest-django's `settings`)."""
    settings.LOOM_BACKENDS = {**settings.LOOM_BACKENDS, BACKEND: f"{__name__}.ThreeNodeBackend"}
    settings.LOOM_BACKEND = BACKEND
    return current_backend()


@pytest.fixture
def backend(settings):
    return use_three_node_backend(settings)


def placed(owner, name, nodes=(), hosts=None, state=states.RUNNING, backend=BACKEND, failure_kind=""):
    """A run whose first attempt the backend put on `nodes`, in `state`; `hosts` maps ranks to the host each
    reported in its heartbeats."""
    run = create_run(owner, name, TINY_CONFIG)
    attempt = run.attempts.get()
    Attempt.objects.filter(pk=attempt.pk).update(
        backend=backend, state=state, nodes=list(nodes), failure_kind=failure_kind
    )
    RankStatus.objects.bulk_create(
        RankStatus(attempt=attempt, rank=rank, host=host) for rank, host in (hosts or {}).items()
    )
    return run


def api(client, method, path, token, body=None):
    kwargs = {"data": json.dumps(body), "content_type": "application/json"} if body is not None else {}
    return getattr(client, method)(path, **kwargs, HTTP_AUTHORIZATION=f"Bearer {token}")


def row_named(table, name):
    (row,) = [row for row in table if row.name == name]
    return row


def test_a_node_names_only_the_users_own_runs_and_counts_everyone_elses_ranks(backend, platform_user, other_user):
    ada = platform_user[0]
    mine = placed(ada, "mine", nodes=["n1", "n2"], hosts={0: "n1.cluster.example", 1: "n1", 2: "n2", 3: "n2"})
    placed(other_user, "theirs", nodes=["n1"], hosts={0: "n1", 1: "n1", 2: "n1"})
    starting = placed(other_user, "theirs-starting", nodes=["n2"], state=states.STARTING)

    table = nodes.node_table(ada, backend).rows
    assert [(row.name, row.state, row.cpus, row.gpus, row.reason) for row in table] == [
        ("n1", "mixed", 16, 2, ""),
        ("n2", "idle", 16, 2, ""),
        ("n3", "down", 8, 0, "Not responding"),
    ]
    n1, n2, n3 = table
    assert n1.runs == [nodes.RunOnNode(mine.pk, "mine", 1, states.RUNNING, [0, 1])]
    assert (n1.other_runs, n1.other_ranks) == (1, 3)
    assert n2.runs == [nodes.RunOnNode(mine.pk, "mine", 1, states.RUNNING, [2, 3])]
    # Placed by the backend, its ranks not heard from yet: a run, no ranks.
    assert (n2.other_runs, n2.other_ranks) == (1, 0)
    assert (n3.runs, n3.other_runs, n3.other_ranks) == ([], 0, 0)

    theirs = nodes.node_table(other_user, backend).rows
    assert [run.run_name for run in row_named(theirs, "n1").runs] == ["theirs"]
    assert row_named(theirs, "n2").runs == [nodes.RunOnNode(starting.pk, "theirs-starting", 1, states.STARTING, [])]
    assert (row_named(theirs, "n1").other_runs, row_named(theirs, "n1").other_ranks) == (1, 2)


def test_the_api_never_names_another_users_run(backend, client, platform_user, other_user, token_for):
    ada = platform_user[0]
    placed(ada, "mine", nodes=["n1"], hosts={0: "n1", 1: "n1"})
    theirs = placed(other_user, "their-secret-run", nodes=["n1"], hosts={0: "n1"})

    response = api(client, "get", "/api/nodes", token_for(ada))
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["backend"], body["unavailable"]) == (BACKEND, "")
    n1 = body["nodes"][0]
    assert n1["name"] == "n1"
    assert [(run["name"], run["ranks"]) for run in n1["runs"]] == [("mine", [0, 1])]
    assert (n1["other_runs"], n1["other_ranks"]) == (1, 1)
    assert "their-secret-run" not in response.content.decode()
    assert theirs.pk not in {run["run"] for node in body["nodes"] for run in node["runs"]}


def test_ended_attempts_and_other_backends_are_not_on_a_node(backend, platform_user):
    ada = platform_user[0]
    placed(ada, "finished", nodes=["n1"], hosts={0: "n1"}, state=states.SUCCEEDED)
    placed(ada, "elsewhere", nodes=["n1"], hosts={0: "n1"}, backend="another")

    n1 = row_named(nodes.node_table(ada, backend).rows, "n1")
    assert (n1.runs, n1.other_runs, n1.other_ranks) == ([], 0, 0)


def test_failures_per_node_count_only_failed_attempts_whose_nodes_include_it(backend, platform_user, other_user):
    ada = platform_user[0]
    placed(ada, "lost n2", nodes=["n1", "n2"], state=states.FAILED, failure_kind="node_failure")
    placed(other_user, "killed", nodes=["n2"], state=states.FAILED, failure_kind="killed")
    placed(ada, "lost n1", nodes=["n1"], state=states.FAILED, failure_kind="node_failure")
    placed(ada, "unclassified", nodes=["n1"], state=states.FAILED)
    placed(ada, "fine", nodes=["n1", "n3"], state=states.SUCCEEDED)
    placed(ada, "stopped", nodes=["n3"], state=states.CANCELLED, failure_kind="cancelled")
    placed(ada, "never placed", state=states.FAILED, failure_kind="invalid_config")
    placed(ada, "another backend", nodes=["n3"], state=states.FAILED, failure_kind="node_failure", backend="another")

    assert nodes.failures_on(backend, "n1") == {"node_failure": 2, "": 1}
    assert nodes.failures_on(backend, "n2") == {"node_failure": 1, "killed": 1}
    assert nodes.failures_on(backend, "n3") == {}
    table = nodes.node_table(ada, backend).rows
    assert {row.name: row.failures for row in table} == {
        "n1": {"": 1, "node_failure": 2},
        "n2": {"killed": 1, "node_failure": 1},
        "n3": {},
    }


def test_exclude_and_include_round_trip_through_the_api(backend, client, platform_user, token_for):
    ada = platform_user[0]
    token = token_for(ada)

    response = api(client, "post", "/api/nodes/n2/exclude", token, {"reason": "ECC errors on GPU 1"})
    assert response.status_code == 200, response.content
    assert {key: response.json()[key] for key in ("backend", "name", "reason", "by")} == {
        "backend": BACKEND,
        "name": "n2",
        "reason": "ECC errors on GPU 1",
        "by": "ada",
    }
    assert nodes.excluded_names(backend) == ["n2"]
    n2 = api(client, "get", "/api/nodes", token).json()["nodes"][1]
    assert n2["name"] == "n2"
    assert (n2["excluded"]["reason"], n2["excluded"]["by"]) == ("ECC errors on GPU 1", "ada")

    # Excluding it again changes nothing: the first reason stands.
    again = api(client, "post", "/api/nodes/n2/exclude", token, {"reason": "flaky"})
    assert (again.status_code, again.json()["reason"]) == (200, "ECC errors on GPU 1")
    assert ExcludedNode.objects.count() == 1

    assert api(client, "delete", "/api/nodes/n2/exclude", token).status_code == 204
    assert nodes.excluded_names(backend) == []
    assert api(client, "get", "/api/nodes", token).json()["nodes"][1]["excluded"] is None
    # Including a node that is not excluded is no error: it is already what was asked.
    assert api(client, "delete", "/api/nodes/n2/exclude", token).status_code == 204


def test_excluding_an_unknown_node_or_without_a_reason_is_a_field_error(backend, client, platform_user, token_for):
    token = token_for(platform_user[0])

    response = api(client, "post", "/api/nodes/n9/exclude", token, {"reason": "broken"})
    assert response.status_code == 400
    assert response.json() == {"errors": {"name": f"backend {BACKEND} has no node 'n9'; its nodes are n1, n2, n3"}}

    response = api(client, "post", "/api/nodes/n1/exclude", token, {"reason": "  "})
    assert response.status_code == 400
    assert "is required" in response.json()["errors"]["reason"]
    assert api(client, "post", "/api/nodes/n1/exclude", token, {}).json()["errors"].keys() == {"reason"}

    too_long = "x" * (nodes.REASON_MAX_CHARS + 1)
    response = api(client, "post", "/api/nodes/n1/exclude", token, {"reason": too_long})
    assert response.json()["errors"]["reason"] == f"must be at most {nodes.REASON_MAX_CHARS} characters (it has 1001)"
    assert not ExcludedNode.objects.exists()


def test_excluded_names_lists_this_backends_exclusions_whoever_made_them(backend, platform_user):
    nodes.exclude_node(backend, "n3", "down twice", by=None)
    nodes.exclude_node(backend, "n1", "slow NVLink", by=platform_user[0])
    ExcludedNode.objects.create(backend="another", name="n2", reason="not this backend's")

    assert nodes.excluded_names(backend) == ["n1", "n3"]
    table = nodes.node_table(platform_user[0], backend).rows
    assert row_named(table, "n3").excluded.by is None
    assert row_named(table, "n1").excluded.by == "ada"
    assert row_named(table, "n2").excluded is None
    assert nodes.include_node(backend, "n1") is True
    assert nodes.include_node(backend, "n1") is False
    assert nodes.excluded_names(backend) == ["n3"]


def test_an_excluded_node_the_backend_no_longer_lists_stays_listed_to_be_included(backend, platform_user):
    ExcludedNode.objects.create(backend=BACKEND, name="n0", reason="removed from the cluster")

    table = nodes.node_table(platform_user[0], backend).rows
    assert [row.name for row in table] == ["n1", "n2", "n3", "n0"]
    assert (table[-1].state, table[-1].excluded.reason) == (nodes.NOT_REPORTED, "removed from the cluster")
    nodes.include_node(backend, "n0")
    assert [row.name for row in nodes.node_table(platform_user[0], backend).rows] == ["n1", "n2", "n3"]


def test_the_nodes_page_shows_own_runs_linked_and_others_as_a_count(backend, client, platform_user, other_user):
    ada = platform_user[0]
    mine = placed(ada, "mine", nodes=["n1"], hosts={0: "n1", 1: "n1"})
    placed(other_user, "their-secret-run", nodes=["n1"], hosts={0: "n1"})
    nodes.exclude_node(backend, "n3", "PSU replaced, burn-in pending", by=None)

    client.force_login(ada)
    page = client.get("/nodes/")
    assert page.status_code == 200
    html = page.content.decode()
    assert f'<a href="/runs/{mine.pk}/">mine</a>' in html
    assert "1 rank of 1 run" in html
    assert "their-secret-run" not in html
    assert 'class="node node-excluded" data-node="n3"' in html
    assert "PSU replaced, burn-in pending" in html
    assert "by loom" in html
    assert html.count('class="exclude-form"') == 2
    assert 'href="/nodes/"' in html


def test_the_nodes_page_and_api_need_a_login(backend, client):
    assert client.get("/nodes/").status_code == 302
    assert client.get("/api/nodes").status_code == 401
    assert client.post("/api/nodes/n1/exclude", {"reason": "x"}, content_type="application/json").status_code == 401


def test_a_backend_that_cannot_list_its_nodes_says_why_and_still_lists_the_excluded(
    settings, client, platform_user, token_for
):
    settings.LOOM_BACKENDS = {**settings.LOOM_BACKENDS, UnreachableBackend.name: f"{__name__}.UnreachableBackend"}
    settings.LOOM_BACKEND = UnreachableBackend.name
    ExcludedNode.objects.create(backend=UnreachableBackend.name, name="n2", reason="ECC errors")
    token = token_for(platform_user[0])
    why = (
        f"the {UnreachableBackend.name} backend could not list its nodes: "
        "sinfo failed (1): Unable to contact slurm controller (connect failure)"
    )

    body = api(client, "get", "/api/nodes", token).json()
    assert body["unavailable"] == why
    assert [(node["name"], node["state"], node["excluded"]["reason"]) for node in body["nodes"]] == [
        ("n2", nodes.NOT_REPORTED, "ECC errors")
    ]
    response = api(client, "post", "/api/nodes/n1/exclude", token, {"reason": "slow"})
    assert response.status_code == 503
    assert response.json() == {"errors": {"backend": f"{why}; try again once it answers"}}
    assert api(client, "delete", "/api/nodes/n2/exclude", token).status_code == 204
    assert not ExcludedNode.objects.exists()

    client.force_login(platform_user[0])
    html = client.get("/nodes/").content.decode()
    assert f"{why}. Only the excluded nodes are listed." in html


def test_the_local_backend_is_this_host_with_the_runs_whose_ranks_report_it(platform_user, other_user):
    local = backend_named("local")
    host = socket.gethostname()
    mine = placed(platform_user[0], "mine", nodes=[host], hosts={0: host, 1: host}, backend="local")
    placed(other_user, "theirs", hosts={0: host}, backend="local")

    (row,) = nodes.node_table(platform_user[0], local).rows
    assert (row.name, row.cpus) == (host, os.cpu_count())
    assert row.runs == [nodes.RunOnNode(mine.pk, "mine", 1, states.RUNNING, [0, 1])]
    assert (row.other_runs, row.other_ranks) == (1, 1)
    nodes.exclude_node(local, host, "its disk is full")
    assert nodes.excluded_names(local) == [host]
