"""Shared fixtures: the real platform (uvicorn + Channels) and a real Celery worker, in threads of the
test process so they share the test database. PostgreSQL/Redis when DATABASE_URL/REDIS_URL are set."""

import os
import socket
import threading
import time
from dataclasses import dataclass

import pytest
import torch
import uvicorn
from celery.contrib.testing.worker import start_worker
from channels.layers import channel_layers
from django.conf import settings
from django.db import connection

from loom.accounts.services import create_api_token, ensure_user
from loom.alerts.detectors import RANK_EXIT
from loom.alerts.models import Alert
from loom.celery import app as celery_app
from loom.runs import states
from loom.runs.models import Attempt
from loom.runs.reconciler import reconcile
from loom.runs.services import send_launch
from tests.slurm_cluster import slurm_cluster  # noqa: F401
from trainer.config import FaultsConfig

# Triton decides when it is first imported whether kernels are compiled or interpreted, and torch
# imports it early in some code paths. Without a GPU the kernel tests interpret kernels on CPU
# tensors, so the switch is set for the whole session before any of that happens.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A queue of this session's own: a demo worker or another test session on the same broker never
# takes (or hands us) a launch. Set before the Celery app first reads its configuration.
settings.CELERY_TASK_DEFAULT_QUEUE = f"loom-tests-{os.getpid()}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PlatformServer:
    """The real ASGI application under uvicorn, in a thread."""

    def __init__(self, port: int, host: str = "127.0.0.1"):
        self.port = port
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(
            uvicorn.Config("loom.asgi:application", host=host, port=port, log_level="warning", lifespan="off")
        )
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{port}", daemon=True)

    def start(self) -> "PlatformServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        # The channel layer is a process-wide object whose receive belongs to one event loop: a consumer
        # still waiting on this server's loop (channels_redis blocks up to its read timeout) would make
        # the next test's server refuse every receive as from "two event loops at once".
        channel_layers.backends.clear()


@dataclass
class LivePlatform:
    url: str
    server: PlatformServer


def wait_for(predicate, timeout: float, interval: float = 0.2, message: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {message}")


def stop_active_attempts() -> None:
    """Ask every launcher still supervising a run to stop it, and wait until they have."""
    Attempt.objects.filter(state__in=states.ACTIVE).update(cancel_requested=True)
    wait_for(
        lambda: not Attempt.objects.filter(state__in=[states.STARTING, states.RUNNING, states.CANCELLING]).exists(),
        timeout=60,
        message="active attempts to stop",
    )


@pytest.fixture(scope="session", autouse=True)
def purge_session_queue():
    """Launches queued by tests that start no worker would otherwise stay in the broker for good."""
    yield
    with celery_app.connection_for_write() as connection:
        connection.default_channel.queue_purge(settings.CELERY_TASK_DEFAULT_QUEUE)


@pytest.fixture
def runs_dir(settings, tmp_path):
    settings.LOOM_RUNS_DIR = tmp_path / "runs"
    return settings.LOOM_RUNS_DIR


@pytest.fixture
def platform_server(request, transactional_db, settings, runs_dir):
    """The web platform alone (pages, API, ingest, websockets), serving the test database; for a test marked
    `slurm`, where the Slurm test cluster's nodes reach it, launching onto that cluster."""
    if request.node.get_closest_marker("slurm"):
        server = serve_for_slurm(settings, request.getfixturevalue("slurm_cluster"))
    else:
        server = PlatformServer(free_port()).start()
        settings.LOOM_URL = settings.LOOM_INGEST_URL = server.url
    try:
        yield server
    finally:
        server.stop()


class ReconcilerLoop:
    """The reconciler's passes, as Celery beat schedules them in a deployment, in a thread of the test process
    (beat's own clock ticks once a second at best; a test wants the pass it is waiting for soon)."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.passes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="reconciler", daemon=True)

    def _loop(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                reconcile(send_launch)
                self.passes += 1
        finally:
            connection.close()

    def __enter__(self) -> "ReconcilerLoop":
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def serve_for_slurm(settings, cluster) -> PlatformServer:
    """The platform where the cluster's nodes reach it (the bridge's address: inside their namespaces the host's
    loopback is not theirs), launching onto the cluster with two ranks per node. For a test module's own
    platform_server; the caller stops it."""
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, cluster.host_address]
    server = PlatformServer(free_port(), host=cluster.host_address).start()
    settings.LOOM_URL = settings.LOOM_INGEST_URL = server.url
    settings.LOOM_BACKEND = "slurm"
    settings.LOOM_SLURM_CONF = str(cluster.conf)
    settings.LOOM_RANKS_PER_NODE = 2
    return server


@pytest.fixture
def live_platform(platform_server, settings):
    """The web platform plus a real Celery worker that launches real torchrun attempts, and the reconciler."""
    settings.LOOM_CANCEL_GRACE_S = 5.0
    # Two CPU cores: at most two runs train at once, the others wait queued.
    settings.LOOM_LOCAL_MAX_ATTEMPTS = 2
    with (
        start_worker(celery_app, pool="threads", concurrency=2, perform_ping_check=False, loglevel="WARNING"),
        ReconcilerLoop(interval_s=0.5),
    ):
        yield LivePlatform(url=platform_server.url, server=platform_server)
        stop_active_attempts()
    assert_no_false_alarms()


def assert_no_false_alarms() -> None:
    """Every real run a test launched without an injected fault is clean: the detectors must have raised
    nothing about it (a failed attempt's rank_exit alert reports a failure the test caused, not a guess)."""
    clean = FaultsConfig()
    false = [
        (alert.run.name, alert.message)
        for alert in Alert.objects.exclude(rule=RANK_EXIT).select_related("run")
        if FaultsConfig.model_validate(alert.run.config.get("faults", {})) == clean
    ]
    assert not false, f"alerts on runs without injected faults: {false}"


@pytest.fixture
def platform_user(db):
    password = "correct horse battery staple"
    return ensure_user("ada", password), password


@pytest.fixture
def other_user(db):
    return ensure_user("mallory", "another password")


@pytest.fixture
def token_for():
    return lambda user: create_api_token(user, "tests")
