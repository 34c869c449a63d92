"""A user's headless Chromium (Debian's chromium, driven by Playwright) for the page benchmarks."""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking"]
VIEWPORT = {"width": 1400, "height": 1000}


def _log_in(page, url: str, username: str, password: str) -> None:
    page.goto(f"{url}/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("button:has-text('Log in')")
    page.wait_for_url(f"{url}/")


def logged_in_page(playwright, url: str, username: str, password: str):
    """(browser, page): a fresh browser with the user logged in on the platform at `url`."""
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    page = browser.new_context(viewport=VIEWPORT).new_page()
    _log_in(page, url, username, password)
    return browser, page


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RunPageFollower:
    """The run page open through a load in a Chromium that no driver watches meanwhile: Playwright logs in
    (into a profile directory), then Chromium is started on its own with that profile on the run page, and
    Playwright attaches over the DevTools protocol only to see the page ready and, at the end, to read what
    it measured. Attached throughout, Playwright's driver receives every websocket frame the page gets
    (1 MB/s at 1,024 ranks) and took a quarter of a core of this 2-core machine, which a user's browser
    on a machine of its own does not."""

    def __init__(self, url: str, run_id: int, username: str, password: str, section: str = "ranks"):
        """`section`: the id of the run page's section the user looks at (the page redraws only the charts
        in view); "ranks" holds the per-rank step time and memory."""
        self.url, self.run_id, self.section = url, run_id, section
        self.username, self.password = username, password
        self._profile = tempfile.TemporaryDirectory(prefix="loom-follower-")
        self._port = _free_port()
        self._process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120.0) -> None:
        """Returns once the page holds its snapshot and follows the run live."""
        from playwright.sync_api import sync_playwright

        with sync_playwright() as playwright:
            context = playwright.chromium.launch_persistent_context(
                self._profile.name, executable_path=CHROMIUM, args=CHROMIUM_ARGS, viewport=VIEWPORT
            )
            _log_in(context.new_page(), self.url, self.username, self.password)
            context.close()
        command = [
            CHROMIUM,
            *CHROMIUM_ARGS,
            f"--user-data-dir={self._profile.name}",
            f"--remote-debugging-port={self._port}",
            f"--window-size={VIEWPORT['width']},{VIEWPORT['height']}",
            f"{self.url}/runs/{self.run_id}/",
        ]
        self._process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._evaluate("window.loomRun && window.loomRun.snapshotSeq !== null", wait_s=timeout_s)
        self._evaluate(f"(document.getElementById({self.section!r}).scrollIntoView(), true)")

    def finish(self, settle_s: float) -> dict:
        """After `settle_s` more seconds (for the last points to arrive and be drawn), what the page measured:
        each drawn point's emit → on-screen ms, and what its websocket brought."""
        time.sleep(settle_s)
        try:
            return self._evaluate(
                """({
                    loss: window.loomRun.drawLatencies,
                    ranks: window.loomRun.rankDrawLatencies,
                    memory: window.loomRun.memoryDrawLatencies,
                    rankStages: window.loomRun.rankDrawStages,
                    lastSeq: window.loomRun.lastSeq,
                    socket: window.loomRun.socket,
                    fetched: window.loomRun.fetched,
                    refetchCosts: window.loomRun.refetchCosts,
                    heavyWork: window.loomRun.heavyWork,
                    notice: document.getElementById("page-notice").hidden
                        ? "" : document.getElementById("page-notice").textContent,
                })"""
            )
        finally:
            self._process.terminate()
            self._process.wait(timeout=30)
            self._profile.cleanup()

    def _evaluate(self, expression: str, wait_s: float = 0.0):
        """Attach, wait until `expression` is truthy on the run page (up to wait_s), answer its value, detach."""
        from playwright.sync_api import sync_playwright

        deadline = time.monotonic() + max(wait_s, 30.0)
        with sync_playwright() as playwright:
            while True:
                try:
                    browser = playwright.chromium.connect_over_cdp(f"http://127.0.0.1:{self._port}")
                    break
                except Exception:  # noqa: BLE001 — Chromium is still starting
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            (page,) = [page for page in browser.contexts[0].pages if f"/runs/{self.run_id}/" in page.url]
            page.wait_for_function(f"() => {expression}", timeout=max(1.0, wait_s) * 1000)
            value = page.evaluate(f"() => ({expression})")
            browser.close()
        return value
