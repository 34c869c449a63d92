"""Webhooks cannot reach into the deployment's own network: an address of every class that is not public is
refused when the webhook is saved, and again at each delivery (after resolving the name, connecting only to
what was checked), a redirect is not followed, and what a delivery records says only coarsely what happened.
The receivers are real HTTP servers on 127.0.0.1, reachable only while LOOM_WEBHOOK_ALLOWED_NETWORKS allows
them."""

import json
import socket
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loom.alerts import webhooks
from loom.alerts.models import Webhook, WebhookDelivery
from loom.runs.services import create_run

from ..conftest import free_port
from .helpers import TINY_CONFIG
from .test_api import api
from .test_webhook_pages import alert_of

REFUSED_AT_SAVE = {
    "http://127.0.0.1/hook": "loopback address",
    "http://localhost:8000/hook": "loopback address",
    "http://[::1]/hook": "loopback address",
    "http://10.0.0.1/hook": "private address",
    "http://172.16.0.1/hook": "private address",
    "https://192.168.1.1/hook": "private address",
    "http://[fc00::1]/hook": "private address",
    "http://169.254.169.254/latest/meta-data/": "link-local address",
    "http://[fe80::1]/hook": "link-local address",
    "http://0.0.0.0:8000/hook": "unspecified address",
    "http://[::]/hook": "unspecified address",
    "http://[::ffff:127.0.0.1]/hook": "loopback address",
    "http://[::ffff:10.0.0.1]/hook": "private address",
    "http://[2002:7f00:1::1]/hook": "loopback address",
    "http://100.64.0.1/hook": "shared (carrier-grade NAT) address",
    "http://224.0.0.1/hook": "multicast address",
    "http://240.0.0.1/hook": "reserved address",
    # Names, not addresses, that the resolver turns into 127.0.0.1.
    "http://2130706433/hook": "loopback address",
    "http://127.1/hook": "loopback address",
}


class Receiver(ThreadingHTTPServer):
    """A webhook receiver on 127.0.0.1 that answers every POST with `status` (and `headers`), keeping each
    request's path, Host header and body."""

    def __init__(self, status=200, headers=None, reason=None):
        self.status, self.headers, self.reason = status, headers or {}, reason
        self.requests = []
        super().__init__(("127.0.0.1", free_port()), ReceiverHandler)

    @property
    def port(self) -> int:
        return self.server_address[1]

    def url(self, host="127.0.0.1") -> str:
        return f"http://{host}:{self.port}/hooks/loom"


class ReceiverHandler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append({"path": self.path, "host": self.headers["Host"], "body": body})
        self.send_response(self.server.status, self.server.reason)
        for name, value in self.server.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def serve():
    servers = []

    def start(tls: ssl.SSLContext | None = None, **kwargs) -> Receiver:
        server = Receiver(**kwargs)
        if tls is not None:
            server.socket = tls.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def owner(platform_user):
    return platform_user[0]


@pytest.fixture
def token(owner, token_for):
    return token_for(owner)


def deliver(owner, url, settings, tries=1) -> WebhookDelivery:
    """One alert's delivery to a webhook at `url` (saved as it is, past the checks), made by the real task."""
    settings.LOOM_WEBHOOK_TRIES = tries
    hook = Webhook.objects.create(owner=owner, url=url)
    alert = alert_of(create_run(owner, "watched", TINY_CONFIG))
    delivery = WebhookDelivery.objects.create(webhook=hook, alert=alert, payload={"event": "alert.opened"})
    webhooks.deliver_webhook.apply(args=[delivery.pk])
    delivery.refresh_from_db()
    return delivery


@pytest.mark.parametrize("url", list(REFUSED_AT_SAVE))
def test_a_webhook_to_an_address_that_is_not_public_is_refused_when_saved(client, owner, token, url):
    answer = api(client, "post", "/api/webhooks", token, {"url": url})

    assert answer.status_code == 400
    message = answer.json()["errors"]["url"]
    assert message.startswith("refused: ") and f" a {REFUSED_AT_SAVE[url]};" in message
    assert list(answer.json()["errors"]) == ["url"]
    assert not Webhook.objects.exists()


@pytest.mark.parametrize(
    "url, message",
    [
        ("ftp://example.com/hook", "must be an http:// or https:// address"),
        ("file:///etc/passwd", "must be an http:// or https:// address"),
        ("hooks.example.com/no-scheme", "must be an http:// or https:// address"),
        ("http://user:secret@93.184.215.14/hook", "must not hold a user name or password"),
        ("http://93.184.215.14/hook\r\nX-Injected: 1", "must not contain spaces or control characters"),
        ("http://93.184.215.14:99999/hook", "must be an http:// or https:// address with a valid host and port"),
        ("http://hooks..example.com/hook", "must name a valid host (labels of 1 to 63 characters)"),
    ],
)
def test_a_webhook_url_that_is_not_plain_http_is_refused(client, token, url, message):
    answer = api(client, "post", "/api/webhooks", token, {"url": url})

    assert (answer.status_code, answer.json()) == (400, {"errors": {"url": message}})
    assert not Webhook.objects.exists()


def test_public_addresses_and_names_that_do_not_resolve_yet_are_taken(client, token):
    # .invalid never resolves (RFC 6761): each delivery resolves and checks the name again.
    for url in ["http://93.184.215.14/hook", "https://[2606:4700::1111]/hook", "https://hooks.invalid/loom"]:
        answer = api(client, "post", "/api/webhooks", token, {"url": url})
        assert (answer.status_code, answer.json()["url"]) == (201, url)


def test_the_deployment_allows_networks_and_host_names(client, token, settings):
    settings.LOOM_WEBHOOK_ALLOWED_NETWORKS = ["10.20.0.0/16", "localhost"]
    for url in ["http://10.20.3.4/hook", "http://localhost:9000/hook"]:
        assert api(client, "post", "/api/webhooks", token, {"url": url}).status_code == 201
    # An allowed name allows that name, not the addresses it resolves to.
    for url in ["http://127.0.0.1:9000/hook", "http://10.21.0.1/hook"]:
        assert set(api(client, "post", "/api/webhooks", token, {"url": url}).json()["errors"]) == {"url"}


@pytest.mark.parametrize("run", [True, False, "1", 1.0, [1], {"id": 1}, ""])
def test_a_run_that_is_not_an_id_is_refused(client, owner, token, run):
    create_run(owner, "first", TINY_CONFIG)
    answer = api(client, "post", "/api/webhooks", token, {"url": "http://93.184.215.14/hook", "run": run})

    assert answer.status_code == 400
    assert answer.json() == {"errors": {"run": "must be a run's id (a whole number), or null for all your runs"}}
    assert not Webhook.objects.exists()


def test_another_users_run_is_refused_as_a_missing_one(client, owner, other_user, token):
    theirs = create_run(other_user, "theirs", TINY_CONFIG)
    mine = create_run(owner, "mine", TINY_CONFIG)
    answers = {
        run: api(client, "post", "/api/webhooks", token, {"url": "http://93.184.215.14/hook", "run": run})
        for run in [theirs.pk, mine.pk + 1000, 0, -1, 2**70]
    }

    assert {answer.status_code for answer in answers.values()} == {400}
    assert len({json.dumps(answer.json()) for answer in answers.values()}) == 1
    assert set(answers[theirs.pk].json()["errors"]) == {"run"}
    assert not Webhook.objects.exists()
    taken = api(client, "post", "/api/webhooks", token, {"url": "http://93.184.215.14/hook", "run": mine.pk})
    assert (taken.status_code, taken.json()["run"]) == (201, mine.pk)


def test_a_receiver_allowed_when_saved_is_not_reached_once_the_allowance_is_gone(client, owner, token, serve, settings):
    receiver = serve()
    settings.LOOM_WEBHOOK_ALLOWED_NETWORKS = ["127.0.0.1/32"]
    assert api(client, "post", "/api/webhooks", token, {"url": receiver.url()}).status_code == 201
    settings.LOOM_WEBHOOK_ALLOWED_NETWORKS = []
    settings.LOOM_WEBHOOK_TRIES = 5
    hook = Webhook.objects.get()
    delivery = WebhookDelivery.objects.create(
        webhook=hook, alert=alert_of(create_run(owner, "watched", TINY_CONFIG)), payload={"event": "alert.opened"}
    )

    webhooks.deliver_webhook.apply(args=[delivery.pk])

    delivery.refresh_from_db()
    assert receiver.requests == []
    # Refused for good, not tried again: the address stays what it is.
    assert (delivery.state, delivery.tries, delivery.last_status) == (WebhookDelivery.FAILED, 1, None)
    assert delivery.last_error == "refused: loopback address"


def test_an_allowed_receiver_gets_the_alert_with_its_own_host_name(owner, serve, settings):
    receiver = serve()
    settings.LOOM_WEBHOOK_ALLOWED_NETWORKS = ["localhost"]

    delivery = deliver(owner, receiver.url("localhost"), settings)

    assert (delivery.state, delivery.tries, delivery.last_status) == (WebhookDelivery.DELIVERED, 1, 200)
    assert delivery.last_error == ""
    assert [(request["path"], request["host"]) for request in receiver.requests] == [
        ("/hooks/loom", f"localhost:{receiver.port}")
    ]


def test_a_delivery_connects_to_the_address_it_checked_without_resolving_again(serve):
    receiver = serve()
    # hooks.invalid resolves to nothing: the request can only have gone to the address it was given.
    connection = webhooks.pinned_connection("http", "hooks.invalid", receiver.port, ["127.0.0.1"])
    try:
        connection.request("POST", "/pinned", body=b"{}", headers={"Content-Length": "2"})
        assert connection.getresponse().status == 200
    finally:
        connection.close()

    assert [(request["path"], request["host"]) for request in receiver.requests] == [
        ("/pinned", f"hooks.invalid:{receiver.port}")
    ]


def test_https_names_the_host_to_tls_and_checks_its_certificate(owner, serve, settings, tmp_path):
    """The socket goes to the checked address, but TLS is told the URL's name (SNI) and the certificate is
    checked against it: a receiver whose certificate no authority signed is not sent the alert."""
    key, certificate = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost"]
        + ["-keyout", str(key), "-out", str(certificate)],
        check=True,
        capture_output=True,
    )
    server_names = []
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certificate, key)
    context.sni_callback = lambda _socket, name, _context: server_names.append(name)
    receiver = serve(tls=context)
    settings.LOOM_WEBHOOK_ALLOWED_NETWORKS = ["localhost"]

    delivery = deliver(owner, f"https://localhost:{receiver.port}/hooks/loom", settings)

    assert server_names == ["localhost"]
    assert (delivery.state, delivery.last_status, delivery.last_error) == (
        WebhookDelivery.FAILED,
        None,
        "failed: TLS error",
    )
    assert receiver.requests == []


def test_a_redirect_is_not_followed(owner, serve, settings):
    inside = serve()
    redirecting = serve(status=302, headers={"Location": inside.url()})
    settings.LOOM_WEBHOOK_ALLOWED_NETWORKS = ["127.0.0.1"]

    delivery = deliver(owner, redirecting.url(), settings)

    assert len(redirecting.requests) == 1 and inside.requests == []
    assert (delivery.state, delivery.last_status) == (WebhookDelivery.FAILED, 302)
    assert delivery.last_error == "failed: HTTP 3xx (redirects are not followed)"


def test_a_delivery_records_only_coarse_outcomes(owner, serve, settings, monkeypatch):
    settings.LOOM_WEBHOOK_ALLOWED_NETWORKS = ["127.0.0.1"]
    failing = serve(status=503, reason="postgres at 10.1.2.3:5432 is down")
    assert deliver(owner, failing.url(), settings).last_error == "failed: HTTP 5xx"

    closed_port = free_port()
    refused = deliver(owner, f"http://127.0.0.1:{closed_port}/hook", settings)
    assert (refused.state, refused.last_status, refused.last_error) == (
        WebhookDelivery.FAILED,
        None,
        "failed: connection error",
    )

    # A listener that takes the connection and never answers.
    silent = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setattr(webhooks, "TIMEOUT_S", 0.3)
    try:
        timed_out = deliver(owner, f"http://127.0.0.1:{silent.getsockname()[1]}/hook", settings)
    finally:
        silent.close()
    assert timed_out.last_error == "failed: timeout"
    for delivery in WebhookDelivery.objects.all():
        assert "10.1.2.3" not in delivery.last_error and "Errno" not in delivery.last_error
