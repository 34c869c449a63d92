"""The address a login came from, for throttling by address. Behind the deployment's TLS proxy
(LOOM_HTTPS, docker/compose.yaml's Caddy) every connection comes from the proxy, so the client is the last
address in X-Forwarded-For: the one the proxy itself added. Entries to its left are whatever the client
chose to send and are never believed."""

from django.conf import settings


def client_address(request) -> str | None:
    if settings.LOOM_HTTPS:
        forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
        last = forwarded.rsplit(",", 1)[-1].strip()
        if last:
            return last
    return request.META.get("REMOTE_ADDR")
