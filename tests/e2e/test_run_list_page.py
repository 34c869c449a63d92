"""In a real Chromium: the run list searched, filtered by state, sorted and paged through with its cursor; a run
tagged on its page (a bad tag shown beside its input first) found by that tag; a run archived on its page gone
from the list and back behind the archived toggle."""

import re

import pytest
from playwright.sync_api import expect

from loom.runs import states
from loom.runs.services import create_run, move_attempt

from ..platform.helpers import TINY_CONFIG, BatchSender, claimed_run

pytestmark = pytest.mark.e2e

VIEWPORT = {"width": 1400, "height": 900}
NAMES = ["alpha 0", "alpha 1", "alpha 2", "alpha 3", "alpha 4", "beta"]


@pytest.fixture
def listed_runs(platform_server, platform_user):
    """Six runs of the user's, oldest first; "beta" trained 3 steps and was cancelled. Made before the browser
    starts: Django refuses ORM calls under Playwright's event loop."""
    owner = platform_user[0]
    runs = {name: create_run(owner, name, TINY_CONFIG) for name in NAMES[:-1]}
    beta, attempt, _ = claimed_run(owner, "beta", {**TINY_CONFIG, "steps": 30})
    move_attempt(attempt, states.RUNNING)
    BatchSender(attempt).send(0, *[
        {"kind": "metric", "time": 100.0 + step, "step": step, "payload": {"loss_mean": 4.5 - step / 10,
                                                                           "tokens_per_s": 500.0}}
        for step in (1, 2, 3)
    ])  # fmt: skip
    move_attempt(attempt, states.CANCELLED)
    runs["beta"] = beta
    return runs


def listed_names(page) -> list[str]:
    return page.locator("table.runs tbody tr td.run-name > a:first-child").all_inner_texts()


def test_search_filter_sort_and_pages(listed_runs, open_logged_in):
    page = open_logged_in("/", VIEWPORT)
    expect(page.locator("table.runs tbody tr")).to_have_count(6)
    beta = page.locator(f'tr[data-run="{listed_runs["beta"].pk}"]')
    expect(beta.locator(".run-layout")).to_have_text("dp_replicate 2 · 2 ranks")
    expect(beta.locator(".run-steps")).to_have_text("3 / 30")
    expect(beta.locator(".run-loss")).to_have_text("4.2000")
    expect(beta.locator(".run-tokens")).to_have_text("1,000")
    expect(beta.locator(".badge")).to_have_text("cancelled")

    # Pages of two, newest first: forward to the end and one back, each run once.
    page.goto("/?limit=2")
    pages = [listed_names(page)]
    for _ in range(2):
        page.click("#next-page")
        expect(page.locator("#previous-page")).to_be_visible()
        pages.append(listed_names(page))
    expect(page.locator("#next-page")).to_have_count(0)
    assert pages == [["beta", "alpha 4"], ["alpha 3", "alpha 2"], ["alpha 1", "alpha 0"]]
    page.click("#previous-page")
    expect(page.locator("table.runs tbody tr").first).to_contain_text("alpha 3")
    assert listed_names(page) == ["alpha 3", "alpha 2"]

    page.goto("/")
    page.fill("#run-search", "ALPHA 3")
    page.press("#run-search", "Enter")
    expect(page.locator("table.runs tbody tr")).to_have_count(1)
    assert listed_names(page) == ["alpha 3"]

    page.fill("#run-search", "")
    page.select_option("#run-state-filter", "cancelled")
    expect(page).to_have_url(re.compile(r"state=cancelled"))
    assert listed_names(page) == ["beta"]

    page.select_option("#run-state-filter", "")
    page.select_option("#run-sort", "-name")
    expect(page).to_have_url(re.compile(r"sort=-name"))
    assert listed_names(page) == list(reversed(NAMES))


def test_a_run_tagged_on_its_page_is_found_by_its_tag_and_an_archived_one_leaves_the_list(listed_runs, open_logged_in):
    run = listed_runs["alpha 2"]
    page = open_logged_in(f"/runs/{run.pk}/", VIEWPORT)
    page.click("#edit-run")
    page.fill("#run-edit-tags", "Favourite, no/spaces!")
    page.fill("#run-edit-note", "the learning rate that worked")
    page.click("#run-edit-save")
    expect(page.locator('#run-edit-form .field-error[data-for="tags"]')).to_contain_text("'no/spaces!' is not a tag")
    expect(page.locator("#run-tags .tag")).to_have_count(0)

    page.fill("#run-edit-tags", "Favourite, lr:3e-4")
    page.fill("#run-edit-name", "alpha 2 (best)")
    page.click("#run-edit-save")
    expect(page.locator("#run-edit-form")).to_be_hidden()
    expect(page.locator("#run-tags .tag")).to_have_text(["favourite", "lr:3e-4"])
    expect(page.locator("#run-name")).to_have_text("alpha 2 (best)")
    expect(page.locator("#run-note")).to_have_text("the learning rate that worked")

    page.locator("#run-tags .tag", has_text="favourite").click()
    expect(page).to_have_url(re.compile(r"/\?tag=favourite$"))
    assert listed_names(page) == ["alpha 2 (best)"]
    page.goto("/")
    page.select_option("#run-tag-filter", "lr:3e-4")
    expect(page.locator("table.runs tbody tr")).to_have_count(1)
    expect(page.locator("td.run-name .run-note")).to_have_text("the learning rate that worked")

    page.goto(f"/runs/{run.pk}/")
    page.click("#archive-run")
    expect(page.locator("#archived-notice")).to_be_visible()
    expect(page.locator("#archive-run")).to_have_text("Unarchive")
    page.goto("/")
    expect(page.locator("table.runs tbody tr")).to_have_count(5)
    assert "alpha 2 (best)" not in listed_names(page)
    page.check("#run-archived")
    expect(page.locator("h1")).to_have_text("Archived runs")
    assert listed_names(page) == ["alpha 2 (best)"]

    page.click("td.run-name > a:first-child")
    page.click("#archive-run")
    expect(page.locator("#archived-notice")).to_be_hidden()
    page.goto("/")
    expect(page.locator("table.runs tbody tr")).to_have_count(6)
    assert page.request.get("/api/runs?archived=true").json()["runs"] == []
