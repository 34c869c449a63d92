"""One rank's HTTP connection to the platform's ingest endpoint, kept alive between batches.

A rank posts about once a second for days; a fresh TCP connection per batch costs both ends a handshake,
a socket and the server's per-connection setup every time (at 1,024 ranks, a thousand connections a
second). A kept-alive connection the server closed while idle fails on its next use before any answer
comes; that one case is retried at once on a fresh connection, which is safe because the platform
stores each (attempt, rank, seq) batch once.
"""

from __future__ import annotations

import enum
import http.client
import urllib.parse

# Sending these again would be refused again, so the batch is set aside instead of retried: every client
# error but a timeout (408) and too many requests (429), which say "later", not "never".
REJECTED_STATUSES = frozenset(range(400, 500)) - {408, 429}
EXCERPT_CHARS = 300


class Delivery(enum.Enum):
    DELIVERED = "delivered"
    REJECTED = "rejected"
    RETRY = "retry"


class IngestConnection:
    def __init__(self, url: str, token: str):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the telemetry url must be http(s)://host[:port][/path], not {url!r}")
        self._secure = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._path = f"{parts.path.rstrip('/')}/api/ingest"
        self._headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
        self._connection: http.client.HTTPConnection | None = None

    def post(self, body: bytes, timeout_s: float) -> tuple[Delivery, str]:
        """POST one batch body; says whether it was stored, refused for good, or should be retried."""
        reused = self._connection is not None
        try:
            return self._post(body, timeout_s)
        except ConnectionError as error:
            self.close()
            if not reused:
                return Delivery.RETRY, f"{type(error).__name__}: {error}"
        except (OSError, http.client.HTTPException) as error:
            self.close()
            return Delivery.RETRY, f"{type(error).__name__}: {error}"
        # The server closed the kept-alive connection while it was idle: once more, on a fresh one.
        try:
            return self._post(body, timeout_s)
        except (OSError, http.client.HTTPException) as error:
            self.close()
            return Delivery.RETRY, f"{type(error).__name__}: {error}"

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _post(self, body: bytes, timeout_s: float) -> tuple[Delivery, str]:
        connection = self._connection or self._connect(timeout_s)
        connection.timeout = timeout_s
        if connection.sock is not None:
            connection.sock.settimeout(timeout_s)
        connection.request("POST", self._path, body=body, headers=self._headers)
        response = connection.getresponse()
        answer = response.read()
        if response.will_close:
            self.close()
        if 200 <= response.status < 300:
            return Delivery.DELIVERED, f"HTTP {response.status}"
        excerpt = answer[:EXCERPT_CHARS].decode("utf-8", "replace").strip() or response.reason
        outcome = Delivery.REJECTED if response.status in REJECTED_STATUSES else Delivery.RETRY
        return outcome, f"HTTP {response.status}: {excerpt}"

    def _connect(self, timeout_s: float) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self._secure else http.client.HTTPConnection
        self._connection = kind(self._host, self._port, timeout=timeout_s)
        return self._connection
