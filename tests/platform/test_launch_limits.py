"""What a new run may ask for (loom/runs/limits.py): a world its launch backend can hold, a model of bounded
size, and one user's share of ranks and of the queue. Each refusal names the field and creates nothing."""

import json

import pytest

from loom.accounts.services import ensure_user
from loom.runs import states
from loom.runs.backends import NodeInfo
from loom.runs.models import ExcludedNode, Run
from loom.runs.services import cancel_run, create_run

from .helpers import TINY_CONFIG, NodeListingBackend

pytestmark = pytest.mark.django_db

CLUSTER = "limits-cluster"
H100 = "NVIDIA H100 80GB HBM3"


class FourNodeCluster(NodeListingBackend):
    """Spreads ranks over nodes as the Slurm backend does, listing one busy node, one idle, one down and one
    idle that loom excludes."""

    name = CLUSTER
    spans_nodes = True
    listed = (
        NodeInfo("c1", "mixed", cpus=16, gpus=2),
        NodeInfo("c2", "idle", cpus=16, gpus=2),
        NodeInfo("c3", "down", cpus=16, gpus=2, reason="Not responding"),
        NodeInfo("c4", "idle", cpus=16, gpus=2),
    )


@pytest.fixture
def cpu_host(settings):
    """The local backend on a host whose ranks train on CPU, with 8 rank slots."""
    settings.LOOM_BACKEND = "local"
    settings.LOOM_LAUNCH_GPUS = "none"
    settings.LOOM_LOCAL_CPU_SLOTS = 8


@pytest.fixture
def token(platform_user, token_for):
    return token_for(platform_user[0])


def create(client, token, config, name="limited"):
    return client.post(
        "/api/runs",
        data=json.dumps({"name": name, "config": config}),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )


def with_parallel(**degrees):
    return {**TINY_CONFIG, "parallel": degrees}


def test_a_world_larger_than_the_hosts_cpu_slots_is_refused_naming_the_largest_degree(client, token, cpu_host):
    response = create(client, token, with_parallel(dp_replicate=4096))
    assert response.status_code == 400, response.content
    assert response.json()["errors"] == {
        "config.parallel.dp_replicate": "the layout needs 4096 ranks but the local backend has room for 8 "
        "(8 CPU rank slots, LOOM_LOCAL_CPU_SLOTS); choose degrees whose product is at most 8"
    }
    assert not Run.objects.exists()


def test_the_cpu_slots_admit_a_world_that_fills_them(client, token, cpu_host):
    response = create(client, token, with_parallel(dp_replicate=2, dp_shard=4))
    assert response.status_code == 201, response.content


def test_on_a_gpu_host_the_world_must_fit_its_gpus(client, token, settings):
    settings.LOOM_BACKEND = "local"
    settings.LOOM_LAUNCH_GPUS = f"{H100},{H100}"
    refused = create(client, token, with_parallel(dp_replicate=2, tp=2))
    assert refused.status_code == 400
    assert "has room for 2 (2 GPUs on this host)" in refused.json()["errors"]["config.parallel.dp_replicate"]
    assert create(client, token, with_parallel(dp_replicate=2)).status_code == 201


def test_a_cluster_holds_its_usable_nodes_times_ranks_per_node(client, token, settings):
    settings.LOOM_BACKENDS = {**settings.LOOM_BACKENDS, CLUSTER: f"{__name__}.FourNodeCluster"}
    settings.LOOM_BACKEND = CLUSTER
    settings.LOOM_RANKS_PER_NODE = 2
    ExcludedNode.objects.create(backend=CLUSTER, name="c4", reason="failed twice")
    # c1 (busy: the run waits for it) and c2 count; c3 is down and c4 excluded.
    refused = create(client, token, with_parallel(tp=2, dp_replicate=3))
    assert refused.status_code == 400
    assert refused.json()["errors"] == {
        "config.parallel.dp_replicate": "the layout needs 6 ranks but the limits-cluster backend has room for 4 "
        "(2 usable nodes × 2 ranks, LOOM_RANKS_PER_NODE); choose degrees whose product is at most 4"
    }
    assert create(client, token, with_parallel(tp=2, dp_replicate=2)).status_code == 201


def test_a_model_beyond_the_parameter_bound_is_refused(client, token, cpu_host):
    huge = {**TINY_CONFIG, "model": {"layers": 512, "dim": 65536, "heads": 512, "kv_heads": 8, "ffn": 172032}}
    response = create(client, token, huge)
    assert response.status_code == 400, response.content
    message = response.json()["errors"]["config.model"]
    assert "more than this platform trains (1,000,000,000,000, LOOM_MAX_MODEL_PARAMETERS)" in message
    assert not Run.objects.exists()


def test_the_parameter_bound_is_a_setting(client, token, cpu_host, settings):
    settings.LOOM_MAX_MODEL_PARAMETERS = 1000
    response = create(client, token, TINY_CONFIG)
    assert response.status_code == 400
    assert (
        "more than this platform trains (1,000, LOOM_MAX_MODEL_PARAMETERS)" in response.json()["errors"]["config.model"]
    )


def test_one_users_active_runs_hold_at_most_their_rank_limit(client, token, cpu_host, settings):
    settings.LOOM_USER_MAX_RANKS = 4
    first = create(client, token, with_parallel(dp_replicate=2), "first")
    assert first.status_code == 201
    assert create(client, token, with_parallel(dp_replicate=2), "second").status_code == 201
    refused = create(client, token, with_parallel(dp_replicate=2), "third")
    assert refused.status_code == 400
    assert refused.json()["errors"] == {
        "config.parallel.dp_replicate": "your active runs hold 4 ranks and this one needs 2, more than the 4 one "
        "user may use at once (LOOM_USER_MAX_RANKS); use fewer ranks or wait until a run ends"
    }
    assert Run.objects.count() == 2
    # Another user's ranks are theirs to count.
    other = ensure_user("grace", "another long password")
    assert create_run(other, "theirs", with_parallel(dp_replicate=4)).state == states.QUEUED
    # A run that ended frees its ranks.
    cancel_run(Run.objects.get(pk=first.json()["id"]))
    assert create(client, token, with_parallel(dp_replicate=2), "third again").status_code == 201


def test_one_user_has_at_most_their_queued_run_limit_waiting(client, token, cpu_host, settings):
    settings.LOOM_USER_MAX_QUEUED = 2
    for name in ("one", "two"):
        assert create(client, token, TINY_CONFIG, name).status_code == 201
    refused = create(client, token, TINY_CONFIG, "three")
    assert refused.status_code == 400
    assert refused.json()["errors"] == {
        "run": "you have 2 queued runs, the most one user may have waiting (LOOM_USER_MAX_QUEUED); "
        "cancel one or wait until one starts"
    }
    assert sorted(Run.objects.values_list("name", flat=True)) == ["one", "two"]
