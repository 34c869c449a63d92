"""Webhook deliveries on pages, through Django's test client: the webhooks page shows each delivery of the
user's own webhooks (a failure with its error and tries, a delivery as delivered, a pending one as still being
retried), and a run's triage page lists that run's deliveries that failed or are pending. Deliveries are made
with the ORM in the state under test; the delivery task itself is tested in test_alert_webhooks.py."""

import pytest
from django.test import Client
from django.utils import timezone

from loom.alerts.models import Alert, Webhook, WebhookDelivery
from loom.runs.services import create_run

from .helpers import TINY_CONFIG

TRIES = 5


@pytest.fixture(autouse=True)
def webhook_tries(settings):
    settings.LOOM_WEBHOOK_TRIES = TRIES


def alert_of(run, rule="straggler", rank=1) -> Alert:
    return Alert.objects.create(
        run=run,
        rule=rule,
        rank=rank,
        key=f"{rule}:{rank}",
        severity="warning",
        step=12,
        last_step=12,
        message=f"{rule} on rank {rank}",
    )


def delivery(webhook, alert, state, tries, status=None, error="") -> WebhookDelivery:
    finished = timezone.now() if state != WebhookDelivery.PENDING else None
    return WebhookDelivery.objects.create(
        webhook=webhook,
        alert=alert,
        payload={"event": "alert.opened", "alert": {"id": alert.pk}},
        state=state,
        tries=tries,
        last_status=status,
        last_error=error,
        finished_at=finished,
    )


def row(page: str, item: WebhookDelivery) -> str:
    start = page.index(f'data-delivery="{item.pk}"')
    return page[page.rindex("<tr", 0, start) : page.index("</tr>", start)]


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_the_webhooks_page_shows_each_delivery_and_why_it_failed(platform_user):
    user = platform_user[0]
    run = create_run(user, "llama-7b", TINY_CONFIG)
    straggler, spike = alert_of(run), alert_of(run, "loss_spike", None)
    everything = Webhook.objects.create(owner=user, url="https://hooks.example.com/all")
    one_run = Webhook.objects.create(owner=user, url="https://hooks.example.com/one", run=run)
    failed = delivery(everything, straggler, WebhookDelivery.FAILED, 5, error="URLError: <urlopen error refused>")
    delivered = delivery(everything, spike, WebhookDelivery.DELIVERED, 2, status=200)
    pending = delivery(one_run, straggler, WebhookDelivery.PENDING, 2, status=503, error="HTTP 503 Unavailable")

    page = logged_in(user).get("/webhooks/").content.decode()

    failed_row = row(page, failed)
    assert 'class="delivery delivery-failed"' in failed_row
    assert "URLError: &lt;urlopen error refused&gt;" in failed_row and f">{TRIES} of {TRIES}<" in failed_row
    assert "no answer" in failed_row
    assert f'href="/runs/{run.pk}/triage/#alert-{straggler.pk}"' in failed_row and "alert.opened" in failed_row
    delivered_row = row(page, delivered)
    assert 'class="delivery delivery-delivered"' in delivered_row and ">delivered<" in delivered_row
    assert ">200<" in delivered_row and "failed" not in delivered_row
    pending_row = row(page, pending)
    assert "pending: still being retried" in pending_row and "HTTP 503 Unavailable" in pending_row
    # Each webhook: its scope and how many of its deliveries failed.
    card = page[page.index(f'id="webhook-{everything.pk}"') : page.index(f'id="webhook-{one_run.pk}"')]
    assert "all runs" in card and "1 failed delivery<" in card
    card = page[page.index(f'id="webhook-{one_run.pk}"') :]
    assert f'run <a href="/runs/{run.pk}/">llama-7b</a>' in card and "0 failed deliveries<" in card
    # The form offers the user's runs.
    assert f'<option value="{run.pk}">llama-7b</option>' in page


def test_someone_elses_webhooks_never_appear(platform_user, other_user):
    user = platform_user[0]
    Webhook.objects.create(owner=user, url="https://hooks.example.com/ada")
    theirs = create_run(other_user, "mallory's run", TINY_CONFIG)
    hook = Webhook.objects.create(owner=other_user, url="https://mallory.example.com/secret", run=theirs)
    delivery(hook, alert_of(theirs), WebhookDelivery.FAILED, 5, status=500, error="HTTP 500 mallory's receiver")

    page = logged_in(user).get("/webhooks/").content.decode()

    assert "https://hooks.example.com/ada" in page
    assert "mallory" not in page and f'data-webhook="{hook.pk}"' not in page


def test_the_webhooks_page_asks_to_log_in(client):
    response = client.get("/webhooks/")
    assert response.status_code == 302 and response["Location"] == "/login/?next=/webhooks/"


def test_triage_lists_the_runs_deliveries_that_failed_or_are_pending(platform_user):
    user = platform_user[0]
    run, other_run = create_run(user, "watched", TINY_CONFIG), create_run(user, "elsewhere", TINY_CONFIG)
    hook = Webhook.objects.create(owner=user, url="https://hooks.example.com/all")
    alert = alert_of(run)
    failed = delivery(hook, alert, WebhookDelivery.FAILED, 5, error="URLError: refused by the receiver")
    pending = delivery(hook, alert, WebhookDelivery.PENDING, 1, status=502, error="HTTP 502 Bad Gateway")
    delivered = delivery(hook, alert_of(run, "loss_spike", None), WebhookDelivery.DELIVERED, 1, status=200)
    elsewhere = delivery(hook, alert_of(other_run), WebhookDelivery.FAILED, 5, error="URLError: another run's")
    client = logged_in(user)

    page = client.get(f"/runs/{run.pk}/triage/").content.decode()

    section = page[page.index('id="webhook-deliveries"') : page.index('id="timeline"')]
    assert "2 notifications of this run's alerts failed or are still being retried" in section
    assert 'href="/webhooks/"' in section
    failed_row, pending_row = row(section, failed), row(section, pending)
    assert "URLError: refused by the receiver" in failed_row and f">{TRIES} of {TRIES}<" in failed_row
    assert 'class="delivery delivery-failed"' in failed_row and f'href="#alert-{alert.pk}"' in failed_row
    assert "pending: still being retried" in pending_row and f">1 of {TRIES}<" in pending_row
    assert f'data-delivery="{delivered.pk}"' not in section
    assert "another run&#x27;s" not in page and f'data-delivery="{elsewhere.pk}"' not in page

    # A run whose deliveries all arrived shows no such section.
    WebhookDelivery.objects.filter(pk=elsewhere.pk).update(state=WebhookDelivery.DELIVERED, last_error="")
    assert "Webhook deliveries" not in client.get(f"/runs/{other_run.pk}/triage/").content.decode()
