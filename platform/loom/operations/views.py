"""GET /metrics for Prometheus: answered to a request bearing LOOM_METRICS_TOKEN or coming from an address
inside LOOM_METRICS_NETWORKS (this host only by default); anything else is refused in the API's JSON shape."""

import hmac
from ipaddress import ip_address

from django.conf import settings
from django.http import HttpResponse, JsonResponse
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from loom.accounts.client_address import client_address
from loom.telemetry.ingest import bearer

from .metrics import registry


@require_GET
def metrics(request):
    refusal = _refusal(request)
    if refusal is not None:
        return refusal
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)


def _refusal(request) -> JsonResponse | None:
    sent = request.headers.get("Authorization", "")
    expected = settings.LOOM_METRICS_TOKEN
    if sent:
        if expected and hmac.compare_digest(bearer(sent).encode(), expected.encode()):
            return None
        return _refused(401, "not the metrics token: send Authorization: Bearer <LOOM_METRICS_TOKEN>")
    address = client_address(request)
    if _inside_allowed_networks(address):
        return None
    if expected:
        return _refused(401, "send Authorization: Bearer <LOOM_METRICS_TOKEN>")
    return _refused(403, f"{address} is outside LOOM_METRICS_NETWORKS, and no LOOM_METRICS_TOKEN is set")


def _inside_allowed_networks(address: str | None) -> bool:
    try:
        parsed = ip_address(address or "")
    except ValueError:
        return False
    # An IPv4 client on a dual-stack socket arrives as ::ffff:a.b.c.d.
    parsed = getattr(parsed, "ipv4_mapped", None) or parsed
    return any(parsed in network for network in settings.LOOM_METRICS_NETWORKS)


def _refused(status: int, message: str) -> JsonResponse:
    response = JsonResponse({"errors": {"authorization": message}}, status=status)
    if status == 401:
        response["WWW-Authenticate"] = "Bearer"
    return response
