"""A user's headless Chromium (Playwright, Debian's chromium) for the page benchmarks."""

from __future__ import annotations

import threading

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking"]
VIEWPORT = {"width": 1400, "height": 1000}


def logged_in_page(playwright, url: str, username: str, password: str):
    """(browser, page): a fresh browser with the user logged in on the platform at `url`."""
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    page = browser.new_context(viewport=VIEWPORT).new_page()
    page.goto(f"{url}/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("button:has-text('Log in')")
    page.wait_for_url(f"{url}/")
    return browser, page


class RunPageFollower:
    """The run page open through a load, in a thread of its own (Playwright's sync API keeps its own event
    loop; the load keeps the main thread's). start() returns once the page holds its snapshot and follows
    the run live; finish() returns what the page measured: each drawn point's emit → on-screen time."""

    def __init__(self, url: str, run_id: int, username: str, password: str):
        self.url, self.run_id = url, run_id
        self.username, self.password = username, password
        self._ready = threading.Event()
        self._finish = threading.Event()
        self._settle_ms = 0.0
        self._result: dict | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._follow, name="run-page-follower", daemon=True)

    def start(self, timeout_s: float = 120.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._error:
            raise RuntimeError(f"the run page did not load: {self._error!r}")

    def finish(self, settle_s: float) -> dict:
        """After `settle_s` more seconds (for the last points to arrive and be drawn), what the page measured."""
        self._settle_ms = settle_s * 1000
        self._finish.set()
        self._thread.join(settle_s + 60)
        if self._error:
            raise RuntimeError("following the run page failed") from self._error
        return self._result

    def _follow(self) -> None:
        from playwright.sync_api import sync_playwright

        try:
            with sync_playwright() as playwright:
                browser, page = logged_in_page(playwright, self.url, self.username, self.password)
                errors = []
                page.on("pageerror", lambda error: errors.append(str(error)))
                page.goto(f"{self.url}/runs/{self.run_id}/")
                page.wait_for_function("() => window.loomRun && window.loomRun.snapshotSeq !== null")
                self._ready.set()
                self._finish.wait()
                page.wait_for_timeout(self._settle_ms)
                self._result = page.evaluate(
                    """() => ({
                        loss: window.loomRun.drawLatencies,
                        ranks: window.loomRun.rankDrawLatencies,
                        lastSeq: window.loomRun.lastSeq,
                        socket: window.loomRun.socket,
                        fetched: window.loomRun.fetched,
                    })"""
                )
                self._result["errors"] = errors
                browser.close()
        except BaseException as error:  # noqa: BLE001 — handed to the main thread, which raises it
            self._error = error
            self._ready.set()
