"""Ranks start with the environment they need, never the platform's secrets (loom/runs/backends/environment.py)."""

import pytest

from loom.runs import states
from loom.runs.backends.environment import rank_environment
from loom.runs.models import Attempt
from loom.runs.services import create_run
from loom.telemetry.models import RankStatus

from ..conftest import wait_for
from ..deployment import environment_of
from .helpers import TINY_CONFIG

PLATFORM_SECRETS = ("LOOM_SECRET_KEY", "DATABASE_URL", "REDIS_URL", "AWS_SECRET_ACCESS_KEY")


def test_the_allow_list_keeps_the_toolchain_and_drops_the_platforms_settings(settings):
    settings.LOOM_RANK_ENV = ["WANDB_API_KEY"]
    toolchain = {
        "PATH": "/usr/bin",
        "HOME": "/home/loom",
        "LC_ALL": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "NCCL_SOCKET_IFNAME": "eth0",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TRITON_INTERPRET": "1",
        "OMP_NUM_THREADS": "1",
        "WANDB_API_KEY": "passed on purpose",
    }
    platform_settings = {
        "LOOM_SECRET_KEY": "s3cret",
        "DATABASE_URL": "postgresql://loom:loom@db/loom",
        "REDIS_URL": "redis://redis:6379/0",
        "LOOM_RUNS_DIR": "/data/runs",
        "AWS_SECRET_ACCESS_KEY": "aws",
    }
    launch = {"LOOM_TOKEN": "attempt_x", "LOOM_URL": "http://ingest:8000"}
    assert rank_environment({**toolchain, **platform_settings}, launch) == {**toolchain, **launch}


@pytest.mark.slow
def test_a_real_runs_supervisor_and_ranks_hold_none_of_the_workers_secrets(live_platform, platform_user, monkeypatch):
    # The worker's environment as a deployment's holds them (the test process is the worker here).
    monkeypatch.setenv("LOOM_SECRET_KEY", "worker-secret-key")
    monkeypatch.setenv("DATABASE_URL", "postgresql://loom:loom@db:5432/loom")
    monkeypatch.setenv("REDIS_URL", "redis://redis:6379/0")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "worker-cloud-credentials")
    # Trains until the test has looked (live_platform stops it); what it learns is not this test's business.
    config = {**TINY_CONFIG, "steps": 100_000, "alerts": {"enabled": False}}
    run = create_run(platform_user[0], "environment", config)
    attempt = run.attempts.get()
    pids = wait_for(
        lambda: (
            dict(RankStatus.objects.filter(attempt=attempt, pid__isnull=False).values_list("rank", "pid"))
            if RankStatus.objects.filter(attempt=attempt, pid__isnull=False).count() == 2
            else None
        ),
        timeout=180,
        message="both ranks to report their pids",
    )
    attempt.refresh_from_db()
    assert attempt.state == states.RUNNING
    supervisor = Attempt.objects.get(pk=attempt.pk).backend_handle["pid"]
    for pid in (supervisor, *pids.values()):
        environment = environment_of(pid)
        assert environment["LOOM_ATTEMPT"] == str(attempt.pk)
        assert environment["LOOM_TOKEN"].startswith("attempt_")
        assert "PATH" in environment
        leaked = [name for name in PLATFORM_SECRETS if name in environment]
        assert not leaked, f"process {pid} started with the platform's {leaked}"
