"""A two-node layout launched from the new-run form onto the real Slurm cluster (tests/slurm_cluster.py), watched
on the run page and found on the Nodes page."""

import re

import pytest
from playwright.sync_api import expect

from tests.conftest import serve_for_slurm

from .tiny_run import TINY_RUN_INPUTS

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.slurm]

TRAINING_TIMEOUT_MS = 300_000


@pytest.fixture
def platform_server(transactional_db, settings, runs_dir, slurm_cluster):
    server = serve_for_slurm(settings, slurm_cluster)
    try:
        yield server
    finally:
        server.stop()


def test_a_two_node_run_from_the_form_trains_on_slurm_and_its_nodes_show(live_platform, open_logged_in, slurm_cluster):
    page = open_logged_in("/runs/new/", {"width": 1280, "height": 1100})
    page.fill("#id_name", "two nodes from the form")
    for field, value in {**TINY_RUN_INPUTS, "steps": "10", "parallel.tp": "2"}.items():
        page.fill(f'[name="{field}"]', value)
    page.click("button:has-text('Create run')")
    page.wait_for_url(re.compile(r"/runs/\d+/$"))
    expect(page.locator("#run-state")).to_have_text("succeeded", timeout=TRAINING_TIMEOUT_MS)
    nodes = page.locator('#attempt-rows tr[data-attempt="1"] .attempt-nodes')
    expect(nodes).to_have_text(re.compile(r"^n[123], n[123]$"))
    used = nodes.inner_text().split(", ")
    # Four ranks, two a node: the heatmap names each rank's node (it is drawn once in view).
    page.locator("#rank-heatmap").scroll_into_view_if_needed()
    page.wait_for_function(
        "(document.getElementById('rank-heatmap').data || [{}])[0].customdata?.length === 4", timeout=60_000
    )
    hosts = page.evaluate("document.getElementById('rank-heatmap').data[0].customdata.map((row) => row[0])")
    assert sorted(set(hosts)) == sorted(used)
    assert hosts[0] == hosts[1] and hosts[2] == hosts[3]

    page.goto("/nodes/")
    expect(page.locator("tr.node")).to_have_count(len(slurm_cluster.nodes))
    for name in slurm_cluster.nodes:
        expect(page.locator(f'tr.node[data-node="{name}"] .node-state')).to_contain_text(
            re.compile(r"idle|mixed|allocated")
        )
