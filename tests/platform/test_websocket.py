"""The run websocket against the real ASGI stack under uvicorn (origin check, session auth, channel layer)."""

import json
import time

import pytest
from django.test import Client
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from loom.telemetry.services import ingest_batch

from .helpers import batch, claimed_run

# Longer than channels_redis' blocking read (BZPOPMIN, 5 s) and redis-py 8's default socket timeout (5 s).
IDLE_S = 12


def socket_url(server, run_id: int) -> str:
    return server.url.replace("http://", "ws://") + f"/ws/runs/{run_id}/"


def open_socket(server, run_id: int, user=None, origin=None):
    headers = {}
    if user is not None:
        client = Client()
        client.force_login(user)
        headers["Cookie"] = f"sessionid={client.cookies['sessionid'].value}"
    return connect(socket_url(server, run_id), origin=origin or server.url, additional_headers=headers, open_timeout=10)


def refused_status(server, run_id: int, user=None, origin=None) -> int:
    """A refused socket never opens: the handshake is answered with an HTTP error instead."""
    with pytest.raises(InvalidStatus) as refused:
        open_socket(server, run_id, user, origin)
    return refused.value.response.status_code


def next_metrics(socket, timeout: float) -> dict:
    """The next message that carries metric events, with only those. The claim's own state events (queued,
    starting) leave through the fan-out's coalescer a moment after it and may reach a socket opened right
    after the claim: they are the run's, not what these tests send. TimeoutError if none comes in time."""
    deadline = time.monotonic() + timeout
    while True:
        message = json.loads(socket.recv(timeout=max(0.0, deadline - time.monotonic())))
        metrics = [event for event in message["events"] if event["kind"] == "metric"]
        if metrics:
            return {**message, "events": metrics}


def test_owner_receives_ingested_events_live(platform_server, platform_user):
    run, attempt, _ = claimed_run(platform_user[0])
    with open_socket(platform_server, run.pk, platform_user[0]) as socket:
        ingest_batch(attempt, 1, 0, batch(attempt, rank=1, steps=(1, 2))["events"])
        message = next_metrics(socket, timeout=10)
    assert message["type"] == "events"
    assert [(e["kind"], e["rank"], e["step"]) for e in message["events"]] == [("metric", 1, 1), ("metric", 1, 2)]
    assert message["events"][1]["seq"] == message["events"][0]["seq"] + 1


def test_anonymous_socket_is_refused(platform_server, platform_user):
    run, _, _ = claimed_run(platform_user[0])
    assert refused_status(platform_server, run.pk) == 403


def test_other_users_socket_is_refused(platform_server, platform_user, other_user):
    run, _, _ = claimed_run(platform_user[0])
    assert refused_status(platform_server, run.pk, other_user) == 403
    assert refused_status(platform_server, run.pk + 1000, platform_user[0]) == 403


def test_foreign_origin_is_refused(platform_server, platform_user):
    run, _, _ = claimed_run(platform_user[0])
    assert refused_status(platform_server, run.pk, platform_user[0], origin="http://evil.example") == 403


def test_a_burst_of_batches_from_many_ranks_reaches_the_page_as_few_messages(platform_server, platform_user):
    run, attempt, _ = claimed_run(platform_user[0])
    ranks = 64
    with open_socket(platform_server, run.pk, platform_user[0]) as socket:
        for rank in range(ranks):
            ingest_batch(attempt, rank, 0, batch(attempt, rank=rank, steps=(1,))["events"])
        received = []
        while sum(len(message["events"]) for message in received) < ranks:
            received.append(next_metrics(socket, timeout=10))
    events = [event for message in received for event in message["events"]]
    assert sorted(event["rank"] for event in events) == list(range(ranks))
    assert [event["seq"] for event in events] == sorted(event["seq"] for event in events)
    assert len(received) < ranks


def test_a_socket_left_idle_longer_than_the_layers_blocking_read_stays_open(platform_server, platform_user):
    """channels_redis waits for a message with a 5 s BZPOPMIN; redis-py 8 reads with a 5 s socket timeout
    by default, which tore every idle consumer down (and the page's socket with it) every 5 s. On the
    in-memory layer of the embedded default the same wait has no socket at all."""
    run, attempt, _ = claimed_run(platform_user[0])
    with open_socket(platform_server, run.pk, platform_user[0]) as socket:
        with pytest.raises(TimeoutError):
            next_metrics(socket, timeout=IDLE_S)
        ingest_batch(attempt, 1, 0, batch(attempt, rank=1, steps=(1,))["events"])
        message = next_metrics(socket, timeout=10)
    assert [(e["kind"], e["rank"], e["step"]) for e in message["events"]] == [("metric", 1, 1)]
