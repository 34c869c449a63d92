"""A real pp 2 × dp 2 × tp 2 run, launched by the platform's Celery worker onto 8 torchrun CPU ranks with
rank 5 slowed down, read back in Chromium through the data behind the run page's heatmaps: the traffic
matrix shows the mesh's structure beside the planner's, and the slow rank is a stripe."""

import itertools
import math
import statistics

import pytest
from playwright.sync_api import expect

from loom.runs.services import create_run
from tests.hybrid import WORLD, hybrid_config, kind_of_pair

from .test_run_panels import chart_data, open_run, wait_for_chart

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SLOW_RANK = 5
SLOW_MS = 400
STEPS = 6
HYBRID_RUN = hybrid_config(STEPS, comm_window_steps=STEPS, faults={"slow_rank": SLOW_RANK, "slow_ms": SLOW_MS})
RUN_TIMEOUT_MS = 400_000


@pytest.fixture
def hybrid_run(live_platform, platform_user):
    # Created before the browser starts: Django refuses ORM calls under Playwright's event loop.
    return create_run(platform_user[0], "pp2 dp2 tp2, rank 5 slowed", HYBRID_RUN)


def heatmap_means(page, metric: str) -> list[float]:
    """Each rank's mean over the steps of the rank × step heatmap coloured by `metric`."""
    page.check(f'input[name="heatmap-metric"][value="{metric}"]')
    page.wait_for_function(f"window.loomRun.panels.heatmap?.metric === '{metric}'")
    (trace,) = chart_data(page, "rank-heatmap")
    assert trace["y"] == list(range(WORLD))
    # Step 1 carries the ranks' start-up (first collectives, allocations) rather than their steps.
    return [statistics.mean(value for value in row[1:] if value is not None) for row in trace["z"]]


def matrix_cells(page, element_id: str) -> dict[tuple[int, int], tuple[float, str]]:
    """(source, destination) → (bytes per step, the kind the cell names), for every cell drawn."""
    cells = page.evaluate(
        """(id) => {
             const [trace] = document.getElementById(id).data;
             const cells = [];
             trace.z.forEach((row, source) => row.forEach((value, destination) => {
               if (value !== null) cells.push([source, destination, value, trace.text[source][destination]]);
             }));
             return cells;
           }""",
        element_id,
    )
    return {(source, destination): (10**value, text.rsplit("· ", 1)[1]) for source, destination, value, text in cells}


def test_the_heatmaps_of_a_real_hybrid_run_show_its_mesh_and_its_slow_rank(hybrid_run, open_logged_in):
    page = open_run(open_logged_in, hybrid_run.pk)
    expect(page.locator("#run-state")).to_have_text("succeeded", timeout=RUN_TIMEOUT_MS)
    page.reload()
    page.wait_for_function("window.loomRun && window.loomRun.snapshotSeq !== null")
    slow_s = SLOW_MS / 1000

    # Every rank waits for the slow one inside the step's collectives, so step times are alike...
    step_times = heatmap_means(page, "step_time_s")
    assert min(step_times) >= 0.9 * slow_s, step_times
    # ...and the step minus its collectives singles it out: the others spend that wait in collectives.
    own_work = heatmap_means(page, "compute_s")
    others = [seconds for rank, seconds in enumerate(own_work) if rank != SLOW_RANK]
    assert own_work[SLOW_RANK] >= slow_s, own_work
    assert own_work[SLOW_RANK] - max(others) >= 0.5 * slow_s, own_work

    # The measured traffic: each pair of ranks that share exactly one mesh dim exchanges that dim's
    # traffic, tp pairs the most, then dp (FSDP), then pp; the planner's matrix has the same structure.
    wait_for_chart(page, "comm-measured-chart", "data.length === 1")
    wait_for_chart(page, "comm-predicted-chart", "data.length === 1")
    assert page.evaluate("window.loomRun.panels.comm.window") == [1, STEPS]
    for element_id in ("comm-measured-chart", "comm-predicted-chart"):
        cells = matrix_cells(page, element_id)
        by_kind: dict[str, list[float]] = {"tp": [], "dp": [], "pp": []}
        for source, destination in itertools.permutations(range(WORLD), 2):
            kind = kind_of_pair(source, destination)
            if kind is None:
                continue
            assert (source, destination) in cells, (element_id, source, destination)
            sent, named = cells[source, destination]
            assert named == kind, (element_id, source, destination, named)
            by_kind[kind].append(sent)
        assert min(by_kind["tp"]) > max(by_kind["dp"]), element_id
        assert min(by_kind["dp"]) > max(by_kind["pp"]) > 0, element_id
        assert all(math.isfinite(sent) for sent, _ in cells.values())
