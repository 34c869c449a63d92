"""A two-node layout launched from the new-run form onto the real Slurm cluster (tests/slurm_cluster.py), watched
on the run page and found on the Nodes page."""

import re

import pytest
from playwright.sync_api import expect

from .tiny_run import TINY_RUN_INPUTS

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.slurm]

TRAINING_TIMEOUT_MS = 300_000


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
    # Four ranks, two a node: the heatmap's answer names each rank's node.
    run_id = re.search(r"/runs/(\d+)/$", page.url).group(1)
    heatmap = page.evaluate(f"fetch('/api/runs/{run_id}/metrics/heatmap?metric=step_time_s').then((r) => r.json())")
    hosts = heatmap["hosts"]
    assert sorted(set(hosts)) == sorted(used)
    assert hosts[0] == hosts[1] and hosts[2] == hosts[3]

    page.goto("/nodes/")
    expect(page.locator("tr.node")).to_have_count(len(slurm_cluster.nodes))
    for name in slurm_cluster.nodes:
        expect(page.locator(f'tr.node[data-node="{name}"] .node-state')).to_contain_text(
            re.compile(r"idle|mixed|allocated")
        )
