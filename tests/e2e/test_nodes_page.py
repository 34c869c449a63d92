"""In a real Chromium: the Nodes page lists the backend's nodes with the user's own run linked and another
user's ranks as a count; Exclude without a reason shows the API's error beside the field and excludes nothing,
with one it marks the node excluded, and Include lets it back in. (The page's event loop owns this thread, so
the test reads the platform through its API, as the page does.)"""

import pytest
from playwright.sync_api import expect

from ..platform.test_nodes import placed, use_three_node_backend
from .test_alert_pages import api

pytestmark = pytest.mark.e2e

VIEWPORT = {"width": 1400, "height": 900}


@pytest.fixture
def runs_on_n1(settings, platform_user, other_user):
    """Made before the browser starts: no ORM call once the page runs."""
    use_three_node_backend(settings)
    mine = placed(platform_user[0], "mine", nodes=["n1"], hosts={0: "n1", 1: "n1"})
    placed(other_user, "their-secret-run", nodes=["n1"], hosts={0: "n1", 1: "n1", 2: "n1"})
    return mine


def excluded_of(page, name):
    status, table = api(page, "GET", "/api/nodes")
    assert status == 200, table
    (node,) = [node for node in table["nodes"] if node["name"] == name]
    return node["excluded"]


def test_a_node_is_excluded_with_a_reason_and_included_again(runs_on_n1, open_logged_in):
    page = open_logged_in("/nodes/", VIEWPORT)
    expect(page.locator("nav a", has_text="Nodes")).to_have_attribute("href", "/nodes/")
    rows = page.locator("tr.node")
    expect(rows).to_have_count(3)
    n1 = page.locator('tr.node[data-node="n1"]')
    expect(n1.locator(".node-runs a")).to_have_text("mine")
    expect(n1.locator(".node-runs a")).to_have_attribute("href", f"/runs/{runs_on_n1.pk}/")
    expect(n1.locator(".node-ranks")).to_have_text("0, 1")
    expect(n1.locator(".node-others")).to_have_text("3 ranks of 1 run")
    expect(page.locator("main")).not_to_contain_text("their-secret-run")
    expect(page.locator('tr.node[data-node="n3"] .node-reason')).to_have_text("Not responding")

    n2 = page.locator('tr.node[data-node="n2"]')
    reason_error = n2.locator('.field-error[data-for="reason"]')
    n2.get_by_role("button", name="Exclude").click()
    expect(reason_error).to_be_visible()
    expect(reason_error).to_contain_text("is required")
    assert excluded_of(page, "n2") is None

    n2.locator("input[name=reason]").fill("ECC errors on GPU 1")
    n2.get_by_role("button", name="Exclude").click()
    expect(n2).to_have_class("node node-excluded")
    expect(n2.locator(".node-excluded-badge")).to_have_text("excluded")
    expect(n2.locator(".node-exclusion-reason")).to_have_text("ECC errors on GPU 1")
    expect(n2.locator(".node-launches")).to_contain_text("by ada")
    excluded = excluded_of(page, "n2")
    assert (excluded["reason"], excluded["by"]) == ("ECC errors on GPU 1", "ada")

    n2.get_by_role("button", name="Include").click()
    expect(n2).to_have_class("node")
    expect(n2.get_by_role("button", name="Exclude")).to_be_visible()
    assert excluded_of(page, "n2") is None
