"""In a real Chromium: on the webhooks page an invalid address gets the API's error beside the URL field and
adds nothing, a valid one for one run is listed with that run, and Delete removes it. (The page's event loop
owns this thread, so the test reads the platform through its API, as the page does.)"""

import pytest
from playwright.sync_api import expect

from loom.runs.services import create_run

from ..platform.helpers import TINY_CONFIG
from .test_alert_pages import api

pytestmark = pytest.mark.e2e

VIEWPORT = {"width": 1280, "height": 900}
RECEIVER = "https://hooks.example.com/loom"


@pytest.fixture
def watched_run(platform_user):
    """Made before the browser starts: no ORM call once the page runs."""
    return create_run(platform_user[0], "watched", TINY_CONFIG)


def test_adding_a_webhook_shows_field_errors_lists_it_and_deletes_it(watched_run, open_logged_in):
    page = open_logged_in("/webhooks/", VIEWPORT)
    form = page.locator("#webhook-form")
    url_error = form.locator('.field-error[data-for="url"]')
    expect(url_error).to_be_hidden()

    form.locator("#webhook-url").fill("hooks.example.com/no-scheme")
    form.locator("button[type=submit]").click()
    expect(url_error).to_have_text("must be an http:// or https:// address")
    expect(url_error).to_be_visible()
    assert api(page, "GET", "/api/webhooks") == [200, []]

    form.locator("#webhook-url").fill(RECEIVER)
    form.locator("#webhook-run").select_option(label="watched")
    form.locator("button[type=submit]").click()
    card = page.locator(".webhook")
    expect(card).to_have_count(1)
    expect(card.locator(".webhook-url")).to_have_text(RECEIVER)
    expect(card.locator(".webhook-scope a")).to_have_attribute("href", f"/runs/{watched_run.pk}/")
    expect(url_error).to_be_hidden()
    status, hooks = api(page, "GET", "/api/webhooks")
    assert status == 200 and [(hook["url"], hook["run"]) for hook in hooks] == [(RECEIVER, watched_run.pk)]

    page.once("dialog", lambda dialog: dialog.accept())
    card.locator(".delete-webhook").click()
    expect(page.locator("#no-webhooks")).to_be_visible()
    expect(page.locator(".webhook")).to_have_count(0)
    assert api(page, "GET", "/api/webhooks") == [200, []]
