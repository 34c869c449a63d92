"""What operators watch (issue 27): GET /metrics, protected, with the platform's figures; the Grafana dashboard
drawn from exactly those metrics; JSON logs naming the run and attempt."""

import io
import json
import logging
import re
import urllib.request
from datetime import timedelta
from ipaddress import ip_network
from pathlib import Path

import pytest
import yaml
from django.db import OperationalError
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from loom.alerts.models import Alert
from loom.operations import collectors
from loom.operations.collectors import DatabaseCollector
from loom.operations.metrics import registry
from loom.operations.structured_logs import JsonFormatter, RunContextFilter, run_context
from loom.runs import states
from loom.runs.models import Attempt, Run
from loom.runs.services import create_run
from loom.runs.tasks import reconcile
from loom.telemetry.fanout import Coalescer

from ..deployment import private_deployment, wait_until
from .helpers import TINY_CONFIG, batch, claimed_run
from .test_ingest_scale import post as post_over_http

REPO_ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = REPO_ROOT / "docker" / "grafana" / "loom-dashboard.json"
FAMILIES = {
    "loom_runs",
    "loom_attempts_started",
    "loom_attempts_failed",
    "loom_alerts",
    "loom_reconciler_lag_seconds",
    "loom_ingest_batches_accepted",
    "loom_ingest_points_accepted",
    "loom_ingest_batches_rejected",
    "loom_ingest_queue_depth",
    "loom_fanout_events",
    "loom_fanout_messages",
    "loom_fanout_dropped_messages",
}
OUTSIDER = "203.0.113.9"
METRICS_TOKEN = "scrape-" + "s" * 40


def scrape(client, **extra) -> dict[str, dict[tuple, float]]:
    """Each family's samples by (sample name, sorted labels), as Prometheus would read the answer."""
    response = client.get("/metrics", **extra)
    assert response.status_code == 200, response.content
    return parsed(response.content.decode())


def parsed(text: str) -> dict[str, dict[tuple, float]]:
    return {
        family.name: {(sample.name, *sorted(sample.labels.items())): sample.value for sample in family.samples}
        for family in text_string_to_metric_families(text)
    }


def sample(families, family: str, name: str | None = None, **labels) -> float:
    return families[family].get((name or family, *sorted(labels.items())), 0.0)


# ---- protection ----


@pytest.mark.django_db
def test_metrics_are_refused_from_an_address_outside_the_networks_without_the_token(client, settings):
    settings.LOOM_METRICS_TOKEN = METRICS_TOKEN
    refused = client.get("/metrics", REMOTE_ADDR=OUTSIDER)
    assert refused.status_code == 401 and refused["WWW-Authenticate"] == "Bearer"
    assert "LOOM_METRICS_TOKEN" in refused.json()["errors"]["authorization"]
    wrong = client.get("/metrics", REMOTE_ADDR="127.0.0.1", HTTP_AUTHORIZATION="Bearer not-the-token")
    assert wrong.status_code == 401 and "errors" in wrong.json()
    answered = client.get("/metrics", REMOTE_ADDR=OUTSIDER, HTTP_AUTHORIZATION=f"Bearer {METRICS_TOKEN}")
    assert answered.status_code == 200 and answered["Content-Type"].startswith("text/plain")
    assert "loom_runs" in answered.content.decode()


@pytest.mark.django_db
def test_without_a_token_only_the_allowed_networks_are_answered(client, settings):
    settings.LOOM_METRICS_TOKEN = ""
    assert client.get("/metrics", REMOTE_ADDR="127.0.0.1").status_code == 200
    assert client.get("/metrics", REMOTE_ADDR="::ffff:127.0.0.1").status_code == 200
    refused = client.get("/metrics", REMOTE_ADDR=OUTSIDER)
    assert refused.status_code == 403
    assert f"{OUTSIDER} is outside LOOM_METRICS_NETWORKS" in refused.json()["errors"]["authorization"]
    settings.LOOM_METRICS_NETWORKS = [*settings.LOOM_METRICS_NETWORKS, ip_network("203.0.113.0/24")]
    assert client.get("/metrics", REMOTE_ADDR=OUTSIDER).status_code == 200


@pytest.mark.django_db
def test_behind_the_tls_proxy_the_address_the_proxy_added_decides(client, settings):
    settings.LOOM_HTTPS = True
    settings.LOOM_METRICS_TOKEN = ""
    # What a client wrote itself (the left entry) is never believed; the proxy's own entry is the last.
    forged = client.get("/metrics", REMOTE_ADDR="127.0.0.1", HTTP_X_FORWARDED_FOR=f"127.0.0.1, {OUTSIDER}", secure=True)
    assert forged.status_code == 403
    proxied = client.get("/metrics", REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR="127.0.0.1", secure=True)
    assert proxied.status_code == 200


# ---- what the database says, at scrape time ----


@pytest.mark.django_db
def test_every_family_is_exposed_with_help_text(client):
    reconcile()
    response = client.get("/metrics")
    text = response.content.decode()
    assert {family.name for family in text_string_to_metric_families(text)} >= FAMILIES
    for name in FAMILIES:
        assert re.search(rf"^# HELP {name}(_total)? \S", text, re.MULTILINE), name


@pytest.mark.django_db
def test_runs_attempts_and_alerts_are_counted_by_label_from_the_database(client, platform_user):
    owner = platform_user[0]
    runs = [create_run(owner, f"run {index}", TINY_CONFIG) for index in range(5)]
    Run.objects.filter(pk__in=[runs[0].pk, runs[1].pk]).update(state=states.RUNNING)
    Run.objects.filter(pk=runs[2].pk).update(state=states.FAILED)
    attempts = [run.attempts.get() for run in runs]
    started = timezone.now()
    Attempt.objects.filter(pk__in=[a.pk for a in attempts[:3]]).update(started_at=started)
    Attempt.objects.filter(pk=attempts[2].pk).update(state=states.FAILED, failure_kind="out_of_memory", retryable=False)
    Attempt.objects.filter(pk=attempts[3].pk).update(state=states.FAILED, failure_kind="lost_peer", retryable=True)
    for rule, state, run in (
        ("straggler", "open", runs[0]),
        ("straggler", "resolved", runs[1]),
        ("hang", "open", runs[1]),
    ):
        Alert.objects.create(
            run=run, rule=rule, key=f"{rule}:0", severity="warning", state=state, step=1, last_step=1, message=rule
        )

    families = scrape(client)
    assert sample(families, "loom_runs", state="running") == 2
    assert sample(families, "loom_runs", state="failed") == 1
    assert sample(families, "loom_runs", state="queued") == 2
    assert sample(families, "loom_runs", state="succeeded") == 0
    assert sample(families, "loom_attempts_started", "loom_attempts_started_total") == 3
    failed = "loom_attempts_failed_total"
    assert sample(families, "loom_attempts_failed", failed, failure_kind="out_of_memory", retryable="false") == 1
    assert sample(families, "loom_attempts_failed", failed, failure_kind="lost_peer", retryable="true") == 1
    assert sample(families, "loom_alerts", rule="straggler", state="open") == 1
    assert sample(families, "loom_alerts", rule="straggler", state="resolved") == 1
    assert sample(families, "loom_alerts", rule="hang", state="open") == 1


@pytest.mark.django_db
def test_the_reconciler_lag_appears_after_a_pass_and_grows_without_one(client):
    assert scrape(client)["loom_reconciler_lag_seconds"] == {}
    reconcile()
    lag = sample(scrape(client), "loom_reconciler_lag_seconds")
    assert 0 <= lag < 5
    # No pass for ten minutes: the scrape then says so (the clock is the collector's, moved on).
    later = DatabaseCollector(now=lambda: timezone.now() + timedelta(minutes=10))
    (family,) = [family for family in later.collect() if family.name == "loom_reconciler_lag_seconds"]
    assert 600 <= family.samples[0].value < 605
    reconcile()
    assert sample(scrape(client), "loom_reconciler_lag_seconds") < 5


@pytest.mark.django_db
def test_a_scrape_while_the_database_fails_still_answers_this_processs_counters(client, monkeypatch):
    def unreachable(job, now):
        raise OperationalError("the database is unreachable")

    monkeypatch.setattr(collectors, "seconds_since_pass", unreachable)
    families = scrape(client)
    assert families["loom_runs"] == {} and families["loom_reconciler_lag_seconds"] == {}
    assert ("loom_ingest_batches_accepted_total",) in families["loom_ingest_batches_accepted"]


# ---- what this process counted ----


@pytest.mark.django_db
def test_an_ingested_batch_moves_the_ingest_counters_by_its_points(client, platform_user):
    run, attempt, token = claimed_run(platform_user[0])
    before = scrape(client)
    body = batch(attempt, rank=0, seq=0, steps=(1, 2, 3, 4))
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
    assert client.post("/api/ingest", body, content_type="application/json", **headers).status_code == 200
    # The same batch again is a duplicate: accepted, nothing more stored.
    assert client.post("/api/ingest", body, content_type="application/json", **headers).status_code == 200
    assert client.post("/api/ingest", "{not json", content_type="application/json", **headers).status_code == 400
    after = scrape(client)

    def moved(family, name, **labels):
        return sample(after, family, name, **labels) - sample(before, family, name, **labels)

    assert moved("loom_ingest_batches_accepted", "loom_ingest_batches_accepted_total") == 2
    assert moved("loom_ingest_points_accepted", "loom_ingest_points_accepted_total") == 4
    assert moved("loom_ingest_batches_rejected", "loom_ingest_batches_rejected_total", status="400") == 1
    assert sample(after, "loom_ingest_queue_depth") == 0


def test_the_asgi_ingest_endpoint_counts_what_it_stores(platform_server, platform_user):
    run, attempt, token = claimed_run(platform_user[0])
    scraped = f"{platform_server.url}/metrics"

    def counters():
        with urllib.request.urlopen(scraped, timeout=30) as response:
            return parsed(response.read().decode())

    before = counters()
    assert post_over_http(platform_server.url, batch(attempt, rank=1, seq=0, steps=(1, 2)), token)[0] == 200
    assert post_over_http(platform_server.url, batch(attempt, rank=1, seq=1), "attempt_not-a-token")[0] == 401
    after = counters()
    accepted = "loom_ingest_points_accepted"
    assert sample(after, accepted, f"{accepted}_total") - sample(before, accepted, f"{accepted}_total") == 2
    rejected = "loom_ingest_batches_rejected"
    assert (
        sample(after, rejected, f"{rejected}_total", status="401")
        - sample(before, rejected, f"{rejected}_total", status="401")
        == 1
    )


def test_fanout_counts_events_messages_and_the_messages_it_could_not_send():
    def value(name, **labels):
        return registry.get_sample_value(name, labels) or 0.0

    def moved(name, before, **labels):
        return value(name, **labels) - before

    events_before, messages_before = value("loom_fanout_events_total"), value("loom_fanout_messages_total")
    dropped_before = value("loom_fanout_dropped_messages_total", reason="send_failed")
    sent = []
    delivering = Coalescer(lambda run_id, events: sent.append(events), interval_s=0.05)
    for seq in (1, 2, 3):
        delivering.add(1, [{"seq": seq}])
    wait_until(lambda: sum(map(len, sent)) == 3, 10, "the three events to be sent")
    assert moved("loom_fanout_events_total", events_before) == 3
    assert moved("loom_fanout_messages_total", messages_before) == len(sent)

    def refuse(run_id, events):
        raise ConnectionError("the channel layer is down")

    Coalescer(refuse, interval_s=0.05).add(2, [{"seq": 1}])
    wait_until(
        lambda: moved("loom_fanout_dropped_messages_total", dropped_before, reason="send_failed") == 1,
        10,
        "the refused message to be counted",
    )
    assert moved("loom_fanout_messages_total", messages_before) == len(sent)


# ---- the dashboard ----


def exposed_names() -> set[str]:
    names = set()
    for family in registry.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.add(f"{family.name}_total")
    return names


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [panel for row in dashboard["panels"] for panel in [row, *row.get("panels", [])]]
    return [target["expr"] for panel in panels for target in panel.get("targets", [])]


@pytest.mark.django_db
def test_the_dashboard_draws_exactly_the_metrics_the_exporter_exposes():
    reconcile()
    exposed = exposed_names()
    expressions = dashboard_expressions()
    assert expressions
    used = set()
    for expression in expressions:
        names = set(re.findall(r"\bloom_[a-zA-Z0-9_:]*", expression))
        assert names, f"{expression} draws no loom metric"
        assert names <= exposed, f"{expression} names {names - exposed}, which the exporter does not expose"
        used |= names
    drawn_families = {name.removesuffix("_total") for name in used}
    assert drawn_families == FAMILIES


def test_the_prometheus_and_grafana_provisioning_files_parse():
    scrape_config = yaml.safe_load((REPO_ROOT / "docker" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape_config["scrape_configs"]}
    assert {job["metrics_path"] for job in jobs.values()} == {"/metrics"}
    provisioning = REPO_ROOT / "docker" / "grafana" / "provisioning"
    for path in provisioning.rglob("*.yaml"):
        assert yaml.safe_load(path.read_text()), path


# ---- JSON logs ----


def formatted(formatter: logging.Formatter, emit) -> str:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    handler.addFilter(RunContextFilter())
    logger = logging.getLogger("loom.tests.operator_logs")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        emit(logger)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


def test_a_record_logged_for_a_run_is_one_json_object_naming_run_and_attempt():
    def emit(logger):
        with run_context(12, 34):
            logger.warning("rank %d is slow", 3)
        logger.info("between runs")

    inside, outside = formatted(JsonFormatter(), emit).splitlines()
    record = json.loads(inside)
    assert record["message"] == "rank 3 is slow" and record["level"] == "WARNING"
    assert (record["run_id"], record["attempt_id"], record["logger"]) == (12, 34, "loom.tests.operator_logs")
    assert "run_id" not in json.loads(outside)


def test_an_exception_stays_inside_its_one_json_line():
    def emit(logger):
        try:
            raise ValueError("bad\nvalue")
        except ValueError:
            logger.exception("it failed")

    (line,) = formatted(JsonFormatter(), emit).splitlines()
    assert "ValueError: bad" in json.loads(line)["exception"]


def test_text_stays_the_message_alone_by_default(settings):
    assert settings.LOOM_LOG_FORMAT == "text"
    console = settings.LOGGING["handlers"]["console"]
    assert "formatter" not in console and "root" not in settings.LOGGING
    assert formatted(logging.Formatter(), lambda logger: logger.warning("plain %s", "words")) == "plain words\n"


# ---- the deployment, scraped after a run ----


@pytest.mark.slow
def test_a_deployment_scraped_after_a_run_shows_its_counters_and_logs_json():
    with private_deployment(LOOM_LOG_FORMAT="json", LOOM_METRICS_TOKEN=METRICS_TOKEN) as deployment:
        answer = deployment.post_run({**TINY_CONFIG, "steps": 6}, name="scraped")
        assert answer.status == 201, answer.body
        run_id = answer.body["id"]
        wait_until(
            lambda: deployment.run(run_id)["state"] in ("succeeded", "failed", "cancelled"),
            300,
            "the run to end",
            interval=1,
        )
        assert deployment.run(run_id)["state"] == "succeeded", deployment.log_tails()
        request = urllib.request.Request(
            f"{deployment.url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}
        )

        def scraped():
            with urllib.request.urlopen(request, timeout=30) as response:
                return parsed(response.read().decode())

        # The reconciler passes every second in the monitor worker; the lag is read from the database.
        families = wait_until(
            lambda: (found := scraped())["loom_reconciler_lag_seconds"] and found, 30, "a reconciler pass"
        )
        assert sample(families, "loom_runs", state="succeeded") == 1
        assert sample(families, "loom_attempts_started", "loom_attempts_started_total") == 1
        accepted = "loom_ingest_points_accepted"
        assert sample(families, accepted, f"{accepted}_total") > 0
        assert sample(families, "loom_ingest_batches_accepted", "loom_ingest_batches_accepted_total") > 0
        assert sample(families, "loom_fanout_events", "loom_fanout_events_total") > 0
        assert 0 <= sample(families, "loom_reconciler_lag_seconds") < 30
        records = [
            json.loads(line)
            for service in (deployment.web, deployment.worker, deployment.monitor)
            for line in service.output_since_start().splitlines()
            if line.startswith("{")
        ]
        assert records
        launched = [record for record in records if "submitted to the local backend" in record["message"]]
        assert [(record["run_id"], record["logger"]) for record in launched] == [(run_id, "loom.runs.launcher")]
        assert isinstance(launched[0]["attempt_id"], int)
