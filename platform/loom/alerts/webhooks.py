"""Webhooks: an alert's change POSTed as JSON to each of its owner's webhooks (all runs, or that run), by a
Celery task that retries with growing waits; every try's outcome is kept on the delivery.

A webhook's URL is the user's, the worker that POSTs to it sits inside the deployment: so webhooks go only to
public addresses (and to the networks and hosts LOOM_WEBHOOK_ALLOWED_NETWORKS allows). The host is resolved
when the webhook is saved and again at every try, refused if any address it resolves to is not allowed, and
the try connects to the addresses it checked, never resolving again (a name that answers differently the
second time cannot slip through). Redirects are not followed. What a try records is coarse, "failed: HTTP 5xx"
or "failed: connection error", never the receiver's words or the socket's: the record must not tell a user
what listens where."""

import http.client
import ipaddress
import json
import socket
import ssl
from urllib.parse import urlsplit

from celery import shared_task
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from loom.runs.models import Run

from .models import Alert, Webhook, WebhookDelivery

TIMEOUT_S = 10.0
MAX_URL_LENGTH = 2000
DEFAULT_PORTS = {"http": 80, "https": 443}
LARGEST_ID = 2**63 - 1
# Neither private nor global: the shared address space of carrier-grade NAT (RFC 6598).
SHARED_ADDRESS_SPACE = ipaddress.ip_network("100.64.0.0/10")
# NAT64's well-known prefix (RFC 6052): the last 32 bits are the IPv4 address a gateway forwards to.
NAT64 = ipaddress.ip_network("64:ff9b::/96")


class WebhookInputError(ValueError):
    def __init__(self, errors: dict[str, str]):
        self.errors = errors
        super().__init__("; ".join(f"{field}: {message}" for field, message in errors.items()))


class RefusedDestination(Exception):
    """The URL's host is, or resolves to, an address webhooks may not reach; the message is its class."""


def create_webhook(owner, url, run_id) -> Webhook:
    """A webhook for all the owner's runs (run_id None) or one of them; field-level errors, nothing saved."""
    errors = {}
    if (problem := url_error(url)) is not None:
        errors["url"] = problem
    if (problem := run_error(owner, run_id)) is not None:
        errors["run"] = problem
    if errors:
        raise WebhookInputError(errors)
    return Webhook.objects.create(owner=owner, url=url.strip(), run_id=run_id)


def url_error(url) -> str | None:
    """What is wrong with `url` as a webhook's address, or None. A host that does not resolve yet is taken:
    every try resolves and checks it again."""
    if not isinstance(url, str) or not url.strip():
        return "required: the http(s) address alerts are POSTed to"
    url = url.strip()
    if len(url) > MAX_URL_LENGTH:
        return f"must be at most {MAX_URL_LENGTH} characters"
    if any(char.isspace() or not char.isprintable() for char in url):
        return "must not contain spaces or control characters"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "must be an http:// or https:// address with a valid host and port"
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname:
        return "must be an http:// or https:// address"
    if parts.username is not None or parts.password is not None:
        return "must not hold a user name or password"
    try:
        checked_addresses(parts.hostname, port or DEFAULT_PORTS[parts.scheme])
    except UnicodeError:
        return "must name a valid host (labels of 1 to 63 characters)"
    except RefusedDestination as refusal:
        verb = "is" if _is_address(parts.hostname) else "resolves to"
        return (
            f"refused: {parts.hostname} {verb} a {refusal}; webhooks go only to public addresses "
            "(a deployment allows more with LOOM_WEBHOOK_ALLOWED_NETWORKS)"
        )
    except OSError:
        pass
    return None


def run_error(owner, run_id) -> str | None:
    """What is wrong with `run_id` as a webhook's run: a run of the owner's, or None for all of them. Another
    user's run is answered as one that does not exist."""
    if run_id is None:
        return None
    # bool is an int to Python, and true would be run 1.
    if isinstance(run_id, bool) or not isinstance(run_id, int):
        return "must be a run's id (a whole number), or null for all your runs"
    if not (0 < run_id <= LARGEST_ID and Run.objects.filter(pk=run_id, owner=owner).exists()):
        return "must be the id of one of your runs, or null for all of them"
    return None


def address_refusal(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why webhooks may not go to `address` (its class: "loopback address"), or None for a public one. An
    IPv6 address that carries an IPv4 one (mapped, 6to4, Teredo, NAT64) is judged by that IPv4 address."""
    if (embedded := _embedded_ipv4(address)) is not None:
        return address_refusal(embedded)
    if address.is_unspecified:
        return "unspecified address"
    if address.is_loopback:
        return "loopback address"
    if address.is_link_local:
        return "link-local address"
    if address.is_multicast:
        return "multicast address"
    if address in SHARED_ADDRESS_SPACE:
        return "shared (carrier-grade NAT) address"
    if address.is_reserved:
        return "reserved address"
    if address.is_private:
        return "private address"
    if not address.is_global:
        return "non-public address"
    return None


def _embedded_ipv4(address) -> ipaddress.IPv4Address | None:
    if address.version != 6:
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def checked_addresses(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, once webhooks may go to each of them; RefusedDestination (with the
    class of the first refused) otherwise, socket.gaierror when it does not resolve."""
    allowed_networks, allowed_hosts = [], set()
    for entry in settings.LOOM_WEBHOOK_ALLOWED_NETWORKS:
        try:
            allowed_networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            allowed_hosts.add(entry.lower().rstrip("."))
    addresses = list(dict.fromkeys(info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)))
    if host.lower().rstrip(".") in allowed_hosts:
        return addresses
    for text in addresses:
        address = ipaddress.ip_address(text)
        if any(address in network for network in allowed_networks):
            continue
        if (refusal := address_refusal(address)) is not None:
            raise RefusedDestination(refusal)
    return addresses


def post_json(url: str, payload: dict) -> int:
    """POST `payload` to `url` at an address checked just now; the receiver's HTTP status. A redirect is
    answered with its 3xx, not followed."""
    parts = urlsplit(url)
    port = parts.port or DEFAULT_PORTS[parts.scheme]
    connection = pinned_connection(parts.scheme, parts.hostname, port, checked_addresses(parts.hostname, port))
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        connection.request(
            "POST",
            target,
            body=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json", "User-Agent": "loom-alerts"},
        )
        return connection.getresponse().status
    finally:
        connection.close()


def pinned_connection(scheme: str, host: str, port: int, addresses: list[str]) -> http.client.HTTPConnection:
    """A connection to `host` that opens its socket to one of `addresses`, never resolving `host`: the Host
    header, TLS's server name and the certificate's check stay `host`."""
    if scheme == "https":
        connection = http.client.HTTPSConnection(host, port, timeout=TIMEOUT_S, context=ssl.create_default_context())
    else:
        connection = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)

    def connect_checked(_host_and_port, timeout, source_address=None):
        failure = None
        for address in addresses:
            try:
                return socket.create_connection((address, port), timeout, source_address)
            except OSError as error:
                failure = error
        raise failure

    # http.client opens every socket through this attribute (HTTPS wraps what it returns in TLS).
    connection._create_connection = connect_checked
    return connection


def outcome_of_status(status: int) -> str:
    """What a try that got an answer records: nothing when delivered, else the status's class."""
    if 200 <= status < 300:
        return ""
    if 300 <= status < 400:
        return "failed: HTTP 3xx (redirects are not followed)"
    return f"failed: HTTP {status // 100}xx"


def queue_deliveries(alert: Alert, change: str, wire: dict) -> list[WebhookDelivery]:
    hooks = Webhook.objects.filter(owner_id=alert.run.owner_id).filter(Q(run__isnull=True) | Q(run_id=alert.run_id))
    payload = {"event": f"alert.{change}", "alert": wire}
    deliveries = [WebhookDelivery.objects.create(webhook=hook, alert=alert, payload=payload) for hook in hooks]
    for delivery in deliveries:
        transaction.on_commit(lambda pk=delivery.pk: deliver_webhook.delay(pk))
    return deliveries


def try_delivery(delivery: WebhookDelivery) -> bool:
    """One POST; True when the receiver took it (2xx). The outcome is saved either way. A refused address
    ends the delivery at once: it is not reached, however often it is tried."""
    delivery.tries += 1
    delivery.last_status, refused = None, False
    try:
        delivery.last_status = post_json(delivery.webhook.url, delivery.payload)
        delivery.last_error = outcome_of_status(delivery.last_status)
    except RefusedDestination as refusal:
        delivery.last_error, refused = f"refused: {refusal}", True
    except TimeoutError:
        delivery.last_error = "failed: timeout"
    except ssl.SSLError:
        delivery.last_error = "failed: TLS error"
    except (OSError, ValueError, http.client.HTTPException):
        delivery.last_error = "failed: connection error"
    delivered = delivery.last_status is not None and 200 <= delivery.last_status < 300
    if delivered or refused or delivery.tries >= settings.LOOM_WEBHOOK_TRIES:
        delivery.state = WebhookDelivery.DELIVERED if delivered else WebhookDelivery.FAILED
        delivery.finished_at = timezone.now()
    delivery.save(update_fields=["tries", "last_status", "last_error", "state", "finished_at"])
    return delivered


def retry_wait_s(tries: int) -> float:
    return settings.LOOM_WEBHOOK_RETRY_BASE_S * 2 ** (tries - 1)


@shared_task(name="loom.alerts.deliver_webhook", bind=True, acks_late=False, ignore_result=True)
def deliver_webhook(self, delivery_id: int) -> None:
    """POST once; on failure try again after LOOM_WEBHOOK_RETRY_BASE_S, doubling, LOOM_WEBHOOK_TRIES in all."""
    delivery = WebhookDelivery.objects.select_related("webhook").filter(pk=delivery_id).first()
    if delivery is None or delivery.state != WebhookDelivery.PENDING:
        return
    if not try_delivery(delivery) and delivery.state == WebhookDelivery.PENDING:
        self.apply_async(args=[delivery_id], countdown=retry_wait_s(delivery.tries))
