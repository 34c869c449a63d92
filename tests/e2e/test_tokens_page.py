"""In a real Chromium: the nav leads to the API tokens page, a token made there is shown once and works for a
script, the list shows it without its value, and Revoke makes the script's next request a 401."""

import urllib.error
import urllib.request

import pytest
from playwright.sync_api import expect

pytestmark = pytest.mark.e2e

VIEWPORT = {"width": 1280, "height": 900}


def script_status(base_url: str, token: str) -> int:
    """What a script holding `token` alone (no session) is answered on GET /api/runs."""
    request = urllib.request.Request(f"{base_url}/api/runs", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_a_token_made_on_the_page_is_shown_once_works_and_is_revoked(platform_server, open_logged_in):
    page = open_logged_in("/", VIEWPORT)
    page.locator("nav a", has_text="API tokens").click()
    page.wait_for_url("**/account/tokens/")

    page.fill("#token-name", "laptop")
    page.select_option("#token-expiry", label="in 7 days")
    page.click("#token-form button[type=submit]")
    value = page.locator("#new-token-value").inner_text()
    assert value.startswith("loom_")
    assert script_status(platform_server.url, value) == 200

    page.goto("/account/tokens/")
    row = page.locator("#tokens tbody tr", has_text="laptop")
    expect(row).to_be_visible()
    expect(row.locator("td").nth(3)).not_to_have_text("never")  # it expires
    expect(page.locator("#new-token-value")).to_have_count(0)
    assert value not in page.content()

    row.locator("button", has_text="Revoke").click()
    expect(page.locator("#tokens tbody tr", has_text="laptop")).to_have_count(0)
    assert script_status(platform_server.url, value) == 401
