"""Webhooks against a real HTTP receiver and the real worker: an alert stored through the live ingest
endpoint is POSTed to the user's webhooks, a failing receiver is retried until it takes it, and an
unreachable one ends failed with its error visible through the API. The receivers listen on 127.0.0.1, which
webhooks reach only because these tests allow it (LOOM_WEBHOOK_ALLOWED_NETWORKS)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from celery.contrib.testing.worker import start_worker

from loom.alerts import detectors
from loom.alerts.models import Webhook, WebhookDelivery
from loom.celery import app as celery_app

from ..conftest import free_port, wait_for
from .helpers import claimed_run
from .test_alerts import rank_metric
from .test_api import api
from .test_ingest_scale import post

FAILURES_BEFORE_OK = 2


class Receiver(ThreadingHTTPServer):
    """Answers 500 to its first FAILURES_BEFORE_OK POSTs, then 200, keeping every body it was sent."""

    def __init__(self):
        self.bodies, self.answers = [], []
        super().__init__(("127.0.0.1", free_port()), ReceiverHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hooks/loom"


class ReceiverHandler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        status = 500 if len(self.server.answers) < FAILURES_BEFORE_OK else 200
        self.server.answers.append(status)
        self.server.bodies.append(body)
        self.send_response(status)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


@pytest.fixture
def worker(platform_server):
    """The real worker, for the webhook tasks (these runs are claimed by hand: no launch to stop after)."""
    with start_worker(celery_app, pool="threads", concurrency=2, perform_ping_check=False, loglevel="WARNING"):
        yield platform_server


@pytest.fixture
def claimed_runs(platform_user, other_user):
    """A run of each user, claimed by hand before the worker starts: a worker already running takes the
    run's launch from the queue and may claim the attempt first. Its launch then finds nothing to do."""
    return claimed_run(platform_user[0]), claimed_run(other_user, "theirs")


@pytest.mark.django_db(transaction=True)
def test_an_alert_is_posted_to_each_webhook_retried_and_failures_are_kept(
    claimed_runs, worker, platform_user, other_user, receiver, client, token_for, settings
):
    settings.LOOM_WEBHOOK_TRIES = 3
    settings.LOOM_WEBHOOK_RETRY_BASE_S = 0.2
    settings.LOOM_WEBHOOK_ALLOWED_NETWORKS = ["127.0.0.1"]
    user = platform_user[0]
    (run, attempt, token), (_, theirs, _) = claimed_runs
    api_token = token_for(user)

    # Field-level errors, nothing saved.
    refused = api(client, "post", "/api/webhooks", api_token, {"url": "ftp://example.com/x", "run": theirs.run_id})
    assert refused.status_code == 400
    assert set(refused.json()["errors"]) == {"url", "run"} and not Webhook.objects.exists()
    everything = api(client, "post", "/api/webhooks", api_token, {"url": receiver.url})
    assert everything.status_code == 201
    unreachable = f"http://127.0.0.1:{free_port()}/nobody-listens"
    assert api(client, "post", "/api/webhooks", api_token, {"url": unreachable, "run": run.pk}).status_code == 201

    # A NaN loss stored through the live ingest endpoint opens the alert.
    events = [rank_metric(0, step) for step in (1, 2, 3)]
    events[2]["payload"]["loss_mean"] = "NaN"
    assert post(worker.url, {"attempt": attempt.pk, "rank": 0, "seq": 0, "events": events}, token)[0] == 200
    wait_for(
        lambda: WebhookDelivery.objects.exclude(state=WebhookDelivery.PENDING).count() == 2,
        timeout=30,
        message="both deliveries to finish",
    )
    assert receiver.answers == [500, 500, 200]
    body = receiver.bodies[-1]
    assert body["event"] == "alert.opened"
    assert (body["alert"]["rule"], body["alert"]["step"], body["alert"]["run"]) == (detectors.NON_FINITE, 3, run.pk)

    hooks = {hook["url"]: hook for hook in api(client, "get", "/api/webhooks", api_token).json()}
    (delivered,) = hooks[receiver.url]["deliveries"]
    assert (delivered["state"], delivered["tries"], delivered["last_status"]) == ("delivered", 3, 200)
    (failed,) = hooks[unreachable]["deliveries"]
    assert (failed["state"], failed["tries"], failed["last_status"]) == ("failed", 3, None)
    assert failed["last_error"] == "failed: connection error"
    # Another user's webhooks are not theirs to see or delete.
    assert api(client, "get", "/api/webhooks", token_for(other_user)).json() == []
    hook_id = hooks[receiver.url]["id"]
    assert api(client, "delete", f"/api/webhooks/{hook_id}", token_for(other_user)).status_code == 404
    assert api(client, "delete", f"/api/webhooks/{hook_id}", api_token).status_code == 204
