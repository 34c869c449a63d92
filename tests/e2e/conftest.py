"""Real headless Chromium for the page tests, and pages opened behind the login form as a user would."""

import re

import pytest
from playwright.sync_api import Page, expect, sync_playwright

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking"]


@pytest.fixture
def browser(platform_server, platform_user):
    # Playwright's sync API keeps an event loop in this thread, and Django refuses ORM calls under
    # one: the platform and the user are set up before the browser starts and torn down after it.
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def open_logged_in(platform_server, platform_user, browser):
    """open_logged_in(path, viewport): a new page that asks for `path`, is sent to the login form,
    logs in there as the platform user and lands back on `path`. Only the web platform is started:
    a test whose runs must train asks for `live_platform` (the Celery worker) too."""
    user, password = platform_user
    contexts = []

    def open_page(path: str, viewport: dict) -> Page:
        context = browser.new_context(base_url=platform_server.url, viewport=viewport)
        contexts.append(context)
        page = context.new_page()
        page.goto(path)
        expect(page).to_have_url(re.compile(rf"/login/\?next={re.escape(path)}$"))
        page.fill("#id_username", user.username)
        page.fill("#id_password", password)
        page.click("button:has-text('Log in')")
        expect(page).to_have_url(f"{platform_server.url}{path}")
        return page

    yield open_page
    for context in contexts:
        context.close()
