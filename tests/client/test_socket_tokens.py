"""A run's websocket opened with an API token (`Authorization: Bearer`), as `loom run watch` opens it, against
the real ASGI stack under uvicorn: the token's user is the socket's, and a bad token is refused whatever
session cookie comes with it."""

import json

import pytest
from django.test import Client
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from loom.accounts.services import create_api_token
from loom.telemetry.services import ingest_batch

from ..platform.helpers import batch, claimed_run


def open_socket(server, run_id: int, token: str | None = None, session_of=None):
    headers = {}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if session_of is not None:
        client = Client()
        client.force_login(session_of)
        headers["Cookie"] = f"sessionid={client.cookies['sessionid'].value}"
    url = server.url.replace("http://", "ws://") + f"/ws/runs/{run_id}/"
    return connect(url, origin=server.url, additional_headers=headers, open_timeout=10)


def refused_status(server, run_id: int, **credentials) -> int:
    with pytest.raises(InvalidStatus) as refused:
        open_socket(server, run_id, **credentials)
    return refused.value.response.status_code


def test_the_owners_token_opens_the_socket_and_events_arrive(platform_server, platform_user):
    owner = platform_user[0]
    run, attempt, _ = claimed_run(owner)
    with open_socket(platform_server, run.pk, token=create_api_token(owner)) as socket:
        ingest_batch(attempt, 0, 0, batch(attempt, rank=0, steps=(1,))["events"])
        while True:
            message = json.loads(socket.recv(timeout=10))
            metrics = [event for event in message["events"] if event["kind"] == "metric"]
            if metrics:
                break
    assert [(event["rank"], event["step"]) for event in metrics] == [(0, 1)]


def test_a_bad_token_is_refused_even_with_the_owners_session(platform_server, platform_user):
    owner = platform_user[0]
    run, _, attempt_token = claimed_run(owner)
    assert refused_status(platform_server, run.pk, token="loom_not-a-token") == 403
    assert refused_status(platform_server, run.pk, token="loom_not-a-token", session_of=owner) == 403
    # An attempt's own token writes telemetry; it is no user's API token.
    assert refused_status(platform_server, run.pk, token=attempt_token) == 403
    # Without the header the session still opens it, as the run page does.
    with open_socket(platform_server, run.pk, session_of=owner):
        pass


def test_another_users_token_is_refused(platform_server, platform_user, other_user):
    run, _, _ = claimed_run(platform_user[0])
    assert refused_status(platform_server, run.pk, token=create_api_token(other_user)) == 403
