"""What /metrics reads when it is scraped: the database's runs, attempts, alerts and the reconciler's last
pass, and the ingest writer's queue. Read then, the database's figures are right whichever process serves
the scrape; the queue is the serving process's own."""

import logging
from collections.abc import Callable
from datetime import datetime

from django.db import DatabaseError
from django.db.models import Count
from django.utils import timezone
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from loom.alerts.models import Alert
from loom.runs import states
from loom.runs.models import Attempt, Run
from loom.telemetry.writer import writer

from .services import RECONCILE, seconds_since_pass

log = logging.getLogger(__name__)


class DatabaseCollector(Collector):
    def __init__(self, now: Callable[[], datetime] = timezone.now):
        self._now = now

    def describe(self):
        # Without it, registering would call collect() to learn the names: a query at start-up.
        return self._families()

    def collect(self):
        try:
            return self._read()
        except DatabaseError as error:
            # The scrape still answers: this process's own counters (ingest's 503s while the database is down)
            # matter most then. These families come without samples.
            log.warning("metrics from the database left out of this scrape: %s", error)
            return self._families()

    def _read(self):
        runs, started, failed, alerts, lag = self._families()
        counts = dict(Run.objects.order_by().values_list("state").annotate(Count("id")))
        for state in states.TRANSITIONS:
            runs.add_metric([state], counts.get(state, 0))
        started.add_metric([], Attempt.objects.filter(started_at__isnull=False).count())
        failures = Attempt.objects.filter(state=states.FAILED).order_by().values_list("failure_kind", "retryable")
        for kind, retryable, count in failures.annotate(Count("id")):
            failed.add_metric([kind or "unclassified", _retryable_label(retryable)], count)
        for rule, state, count in Alert.objects.order_by().values_list("rule", "state").annotate(Count("id")):
            alerts.add_metric([rule, state], count)
        lag_s = seconds_since_pass(RECONCILE, self._now())
        if lag_s is not None:
            lag.add_metric([], lag_s)
        return [runs, started, failed, alerts, lag]

    @staticmethod
    def _families():
        return [
            GaugeMetricFamily("loom_runs", "Runs by state (a run's state is its latest attempt's).", labels=["state"]),
            CounterMetricFamily("loom_attempts_started", "Attempts whose ranks started (the backend ran them)."),
            CounterMetricFamily(
                "loom_attempts_failed",
                "Failed attempts by class (runs/failures.py) and whether the class is worth another try.",
                labels=["failure_kind", "retryable"],
            ),
            GaugeMetricFamily(
                "loom_alerts", "Alerts by rule and state (open, acknowledged, resolved).", labels=["rule", "state"]
            ),
            GaugeMetricFamily(
                "loom_reconciler_lag_seconds",
                "Seconds since the reconciler last finished a pass (due every LOOM_RECONCILE_INTERVAL_S); "
                "absent until its first.",
            ),
        ]


def _retryable_label(retryable: bool | None) -> str:
    return "unknown" if retryable is None else str(retryable).lower()


def register_scrape_time_collectors(registry: CollectorRegistry) -> None:
    registry.register(DatabaseCollector())
    queue_depth = Gauge(
        "loom_ingest_queue_depth",
        "Telemetry batches waiting for this process's group-commit writer (refused with 503 at its limit).",
        registry=registry,
    )
    queue_depth.set_function(writer.waiting)
