"""The registry GET /metrics answers from, and the counters the platform keeps in the process that counts.

No multiprocess mode: every process that counts here serves /metrics itself. docker/compose.yaml runs
each ASGI service as one uvicorn process (`web`, and `ingest`, which alone takes the ranks' batches), and
Prometheus scrapes each of them (docker/prometheus.yml); counters start at zero with their process, which
rate() and increase() read as a reset. Celery workers serve no HTTP, so what they fan out (the platform's
own state events) is not counted. What the database knows is read at scrape time (collectors.py).
"""

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics

# A counter's *_created series (when this process made it) would double every scrape for nothing a dashboard
# draws; a restart shows as the counter's reset.
disable_created_metrics()
registry = CollectorRegistry()

ingest_batches_accepted = Counter(
    "loom_ingest_batches_accepted",
    "Telemetry batches answered 200: stored now, or a duplicate of a batch stored before.",
    registry=registry,
)
ingest_points_accepted = Counter(
    "loom_ingest_points_accepted",
    "Telemetry events (metric points, heartbeats, logs, ...) stored by accepted batches.",
    registry=registry,
)
ingest_batches_rejected = Counter(
    "loom_ingest_batches_rejected",
    "Telemetry batches refused, by HTTP status: 400 invalid, 401 token, 403 another attempt, 409 conflict, "
    "413 too large, 415 not JSON, 503 busy or not stored (the rank retries these), 500 unexpected.",
    ["status"],
    registry=registry,
)
fanout_events = Counter(
    "loom_fanout_events",
    "Stored events handed to the run pages' websocket fan-out.",
    registry=registry,
)
fanout_messages = Counter(
    "loom_fanout_messages",
    "Websocket messages sent to run groups; fan-out coalesces, so events / messages is events per message.",
    registry=registry,
)
fanout_dropped_messages = Counter(
    "loom_fanout_dropped_messages",
    "Run-page websocket messages lost (the pages fill the gap from the REST API): send_failed, a group "
    "message the channel layer refused; receiver_closed, a message popped just as its page's socket closed.",
    ["reason"],
    registry=registry,
)
SEND_FAILED = "send_failed"
RECEIVER_CLOSED = "receiver_closed"
for reason in (SEND_FAILED, RECEIVER_CLOSED):
    # Present at zero from the start: a dashboard's rate() needs the series before the first drop.
    fanout_dropped_messages.labels(reason)


def count_ingest_answer(status: int, points_stored: int) -> None:
    if status == 200:
        ingest_batches_accepted.inc()
        ingest_points_accepted.inc(points_stored)
    else:
        ingest_batches_rejected.labels(str(status)).inc()
