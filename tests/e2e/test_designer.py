"""The designer page in real headless Chromium against the real platform: live estimates drawn from
the planner API as fields change, errors beside their fields, search results loaded into the form,
and a launch that trains on CPU ranks and shows its prediction beside what it measured."""

import re

import pytest
from playwright.sync_api import expect

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SCREENSHOT = "/tmp/loom-designer.png"
RUN_SCREENSHOT = "/tmp/loom-designed-run.png"
ESTIMATE_TIMEOUT_MS = 15_000
TRAINING_TIMEOUT_MS = 240_000

# The data behind the memory chart, as Plotly holds it: one trace per term name, one bar per pp rank.
MEMORY_BARS = """() => Object.fromEntries(
  document.getElementById("memory-chart").data.map((trace) => [trace.name, trace.y])
)"""
TIMELINE_TRACES = """() => document.getElementById("timeline-chart").data.map(
  (trace) => ({name: trace.name, ranks: [...new Set(trace.y)]})
)"""
# The same numbers, from the estimate the page keeps: the chart must show the estimate it holds.
MEMORY_BARS_FROM_ESTIMATE = """() => {
  const ranks = window.loomDesign.estimate.memory.ranks;
  const names = [...new Set(ranks.flatMap((rank) => rank.terms.map((term) => term.name)))];
  return Object.fromEntries([
    ...names.map((name) => [name, ranks.map((rank) => {
      const term = rank.terms.find((item) => item.name === name);
      return term ? term.value / 2 ** 30 : 0;
    })]),
    ["allocator fragmentation", ranks.map((rank) => (rank.reserved_bytes - rank.allocated_bytes) / 2 ** 30)],
  ]);
}"""
# The estimate the planner API gives the bare preset the page opens with, defaults and all.
BARE_PRESET_ESTIMATE = """async () => {
  const response = await loom.post("/api/plan/estimate", { config: { model: { preset: "llama3-8b" } } });
  return response.json();
}"""
# Holds back the answers to estimates of one tp degree, so that a later edit's answer arrives first.
SLOW_ESTIMATES_FOR_TP = """(slowTp) => {
  const realFetch = window.fetch;
  window.slowEstimatesAnswered = 0;
  window.fetch = async (url, options) => {
    const slow = String(url).endsWith("/api/plan/estimate") && JSON.parse(options.body).config.parallel.tp === slowTp;
    const response = await realFetch(url, options);
    if (slow) {
      await new Promise((resolve) => setTimeout(resolve, 1500));
      window.slowEstimatesAnswered += 1;
    }
    return response;
  };
}"""
# Where a Pareto-front point is drawn, from Plotly's own axes: the test clicks it as a user would.
PARETO_POINT_ON_SCREEN = """(index) => {
  const chart = document.getElementById("pareto-chart");
  const { xaxis, yaxis, _size: plot } = chart._fullLayout;
  const front = chart.data.find((trace) => trace.name === "Pareto front");
  const box = chart.getBoundingClientRect();
  return [box.left + plot.l + xaxis.l2p(front.x[index]), box.top + plot.t + yaxis.l2p(front.y[index])];
}"""


@pytest.fixture
def designer(open_logged_in):
    """The designer page, logged in through the login form, with its first estimate drawn."""
    page = open_logged_in("/plan/", {"width": 1400, "height": 1200})
    script_errors = []
    page.on("pageerror", lambda error: script_errors.append(error))
    page.wait_for_function("window.loomDesign?.estimate", timeout=ESTIMATE_TIMEOUT_MS)
    yield page
    assert not script_errors, script_errors


def set_field(page, path: str, value: str) -> None:
    field = page.locator(f'[data-path="{path}"]')
    if field.evaluate("element => element.tagName") == "SELECT":
        field.select_option(value)
    else:
        field.fill(value)


def wait_for_estimate(page, condition: str) -> None:
    """Until the drawn estimate satisfies `condition`, a JS expression over `estimate`."""
    page.wait_for_function(
        f"(() => {{ const estimate = window.loomDesign.estimate; return {condition}; }})()",
        timeout=ESTIMATE_TIMEOUT_MS,
    )


def field_error(page, path: str):
    return page.locator(f'.field-error[data-for="{path}"]')


def test_estimates_follow_the_fields_and_errors_show_beside_them(designer):
    page = designer
    estimate = page.evaluate("window.loomDesign.estimate")
    assert estimate["config"]["model"]["layers"] == 32 and estimate["layout"]["world_size"] == 8
    assert page.locator("#design-preset").input_value() == "llama3-8b"
    set_field(page, "cluster.nodes", "2")
    wait_for_estimate(page, "estimate.cluster.nodes === 2")
    before = page.evaluate(MEMORY_BARS)
    assert {"parameters", "activations"} <= set(before) and all(len(bars) == 1 for bars in before.values())
    usable, hbm = page.evaluate("document.getElementById('memory-chart').layout.shapes.map((line) => line.y0)")
    assert hbm == pytest.approx(81_559 / 1024)  # an H100's 80 GiB as its driver exposes them
    assert usable == pytest.approx(page.evaluate("window.loomDesign.estimate.memory.usable_bytes") / 2**30)
    assert usable < hbm
    expect(page.locator("#summary-peak")).to_contain_text("GiB usable")
    expect(page.locator("#summary-headroom")).to_have_text(re.compile(r"^\d+\.\d GiB$"))

    set_field(page, "parallel.tp", "2")
    wait_for_estimate(page, "estimate.config.parallel.tp === 2")
    after = page.evaluate(MEMORY_BARS)
    assert after["parameters"][0] == pytest.approx(before["parameters"][0] / 2, rel=0.01)
    drawn = page.evaluate(
        "window.loomDesign.estimate.memory.ranks[0].terms.find((term) => term.name === 'activations').value"
    )
    assert after["activations"][0] == pytest.approx(drawn / 2**30, rel=1e-3)
    # Under tensor parallelism loom's trainer runs torch's norm and SwiGLU: their fp32 intermediates outweigh the split.
    assert after["activations"][0] != pytest.approx(before["activations"][0])
    assert page.evaluate("window.loomDesign.lastRequest.config.parallel.tp") == 2
    page.wait_for_function("document.getElementById('traffic-chart').data?.[0]?.z.length === 16")
    hover = page.evaluate("document.getElementById('traffic-chart').data[0].text[0]")
    assert re.match(r"tp \d+\.\d [KMG]iB$", hover[1]) and hover[0] == ""  # rank 0 sends to its tp peer only
    heatmap = page.evaluate("document.getElementById('traffic-chart').data[0]")
    assert heatmap["colorbar"]["title"]["text"] in ("KiB", "MiB", "GiB")
    assert re.match(r"\d+\.\d [KMG]iB$", heatmap["customdata"][0][1])

    set_field(page, "parallel.tp", "3")
    expect(field_error(page, "parallel.tp")).to_contain_text("must divide model.heads=32")
    expect(page.locator('.input[data-field="parallel.tp"]')).to_have_class(re.compile("has-error"))
    assert page.evaluate("window.loomDesign.estimate.config.parallel.tp") == 2  # the charts keep the last good one

    set_field(page, "parallel.tp", "abc")
    expect(field_error(page, "parallel.tp")).to_contain_text("valid integer")

    set_field(page, "parallel.tp", "1")
    set_field(page, "cluster.nodes", "4")
    expect(field_error(page, "parallel.tp")).to_be_hidden()
    expect(page.locator("#design-banner")).to_contain_text("uses 8 of the cluster's 32 GPUs")


def test_an_answer_to_an_earlier_edit_that_arrives_late_is_not_drawn(designer):
    page = designer
    set_field(page, "cluster.nodes", "4")
    wait_for_estimate(page, "estimate.cluster.nodes === 4")
    page.evaluate(SLOW_ESTIMATES_FOR_TP, 2)
    set_field(page, "parallel.tp", "2")
    page.wait_for_function("window.loomDesign.lastRequest.config.parallel.tp === 2")
    set_field(page, "parallel.tp", "4")
    wait_for_estimate(page, "estimate.config.parallel.tp === 4")
    page.wait_for_function("window.slowEstimatesAnswered === 1", timeout=ESTIMATE_TIMEOUT_MS)
    page.wait_for_timeout(200)
    assert page.evaluate("window.loomDesign.estimate.config.parallel.tp") == 4
    assert page.evaluate(MEMORY_BARS) == page.evaluate(MEMORY_BARS_FROM_ESTIMATE)


def test_a_pipeline_draws_its_schedule_timeline(designer):
    page = designer
    expect(page.locator("#timeline-card")).to_be_hidden()
    set_field(page, "cluster.nodes", "2")
    set_field(page, "data.micro_batch", "4")
    set_field(page, "parallel.microbatches", "4")
    set_field(page, "parallel.pp", "2")
    wait_for_estimate(page, "estimate.timeline !== null && estimate.timeline.microbatches === 4")
    expect(page.locator("#timeline-card")).to_be_visible()
    traces = page.evaluate(TIMELINE_TRACES)
    assert {trace["name"] for trace in traces} >= {"forward"}
    assert all(sorted(trace["ranks"]) == [0, 1] for trace in traces)
    memory_ranks = page.evaluate("document.getElementById('memory-chart').data[0].x")
    assert memory_ranks == ["pp rank 0", "pp rank 1"]
    expect(page.locator("#summary-bubble")).not_to_have_text("0.0 %")
    expect(page.locator("#terms-rows")).to_contain_text("pipeline bubble")


def test_a_search_result_loads_into_the_form(designer):
    page = designer
    page.fill("#search-batch", "32")
    expect(page.locator("#search-runnable-only")).to_be_checked()
    page.click("#search")
    first_row = page.locator("#search-rows tr").first
    expect(first_row).to_be_visible(timeout=60_000)
    expect(page.locator("#pareto-card")).to_be_visible()
    assert page.evaluate("window.loomDesign.lastSearch.runnable_only") is True
    assert set(page.locator("#search-rows td:last-child").all_text_contents()) == {"yes"}
    best = page.evaluate("window.loomDesign.search.results[0].config")
    first_row.click()
    for path in ("parallel.tp", "parallel.dp_shard", "parallel.pp", "data.micro_batch"):
        section, field = path.split(".")
        assert page.locator(f'[data-path="{path}"]').input_value() == str(best[section][field])
    wait_for_estimate(
        page,
        f"estimate.config.parallel.tp === {best['parallel']['tp']} && "
        f"estimate.config.data.micro_batch === {best['data']['micro_batch']}",
    )

    smallest = page.evaluate("window.loomDesign.search.pareto[0].config")
    assert smallest != best
    page.locator("#pareto-chart").scroll_into_view_if_needed()
    page.mouse.click(*page.evaluate(PARETO_POINT_ON_SCREEN, 0))
    wait_for_estimate(
        page,
        f"estimate.config.data.micro_batch === {smallest['data']['micro_batch']} && "
        f"estimate.config.parallel.pp === {smallest['parallel']['pp']} && "
        f"estimate.config.compute.recompute === '{smallest['compute']['recompute']}'",
    )


def test_the_page_opens_with_the_planners_defaults(designer):
    """The designer's starting form is the bare preset with the planning defaults the CLI and the API
    apply: the page's first estimate is the API's for {"preset": "llama3-8b"} alone."""
    page = designer
    drawn = page.evaluate("window.loomDesign.estimate")
    bare = page.evaluate(BARE_PRESET_ESTIMATE)
    assert bare["defaults"]["parallel.dp_shard"] == 8
    assert drawn["config"] == bare["config"]
    assert drawn["memory"]["peak_bytes"] == bare["memory"]["peak_bytes"]
    assert drawn["tokens_per_s"] == bare["tokens_per_s"]


def test_export_copies_and_downloads_the_exported_text(designer, tmp_path):
    page = designer
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.select_option("#export-format", "megatron")
    page.click("#export")
    expect(page.locator("#export-text")).to_contain_text("--rotary-base=500000")
    expect(page.locator("#export-warnings")).to_contain_text("optimizer.lr: lr 0.003 is loom's demo default")
    expect(page.locator("#export-estimates")).to_contain_text("On megatron: ")
    expect(page.locator("#export-estimates")).to_contain_text("On loom's trainer: ")
    exported = page.locator("#export-text").text_content()

    page.click("#export-copy")
    expect(page.locator("#export-copy-status")).to_have_text("copied")
    assert page.evaluate("navigator.clipboard.readText()") == exported

    with page.expect_download() as waiting:
        page.click("#export-download")
    download = waiting.value
    assert download.suggested_filename == "loom-megatron-args.txt"
    saved = tmp_path / download.suggested_filename
    download.save_as(saved)
    assert saved.read_text() == exported + "\n"


def test_export_shows_the_layout_for_another_trainer(designer):
    page = designer
    page.click("#export")
    expect(page.locator("#export-panel")).to_be_visible()
    expect(page.locator("#export-text")).not_to_be_empty()
    page.select_option("#export-format", "megatron")
    page.click("#export")
    expect(page.locator("#export-text")).to_contain_text("--tensor-model-parallel-size")


def test_launch_refuses_what_the_trainer_cannot_run_beside_the_field(designer):
    page = designer
    page.select_option("#design-preset", "mixtral-8x7b")
    wait_for_estimate(page, "estimate.config.model.experts === 8")
    # The planner prices expert parallelism across HSDP's replicas; the trainer spreads experts over the ranks that
    # shard the model only.
    set_field(page, "parallel.dp_replicate", "2")
    set_field(page, "parallel.dp_shard", "4")
    set_field(page, "parallel.ep", "8")
    wait_for_estimate(page, "estimate.config.parallel.ep === 8 && estimate.config.parallel.dp_shard === 4")
    page.click("#launch")
    expect(field_error(page, "parallel.ep")).to_contain_text("ranks that shard the model")
    assert page.url.endswith("/plan/")
    set_field(page, "parallel.ep", "1")  # a dense model takes no expert parallelism
    page.select_option("#design-preset", "llama3-8b")  # a preset sets every model field, experts too
    expect(page.locator('[data-path="model.experts"]')).to_have_value("1")
    wait_for_estimate(page, "estimate.config.model.experts === 1")


def test_launch_creates_the_run_with_its_estimate_and_its_page_compares_them(live_platform, designer):
    page = designer
    page.select_option("#design-preset", "loom-tiny")
    layout = {
        "parallel.dp_shard": "1",
        "parallel.dp_replicate": "2",
        "compute.precision": "fp32",
        "compute.recompute": "none",
        "data.micro_batch": "4",
        "steps": "3",
    }
    for path, value in layout.items():
        set_field(page, path, value)
    wait_for_estimate(
        page, "estimate.config.model.dim === 64 && estimate.layout.world_size === 2 && estimate.config.steps === 3"
    )
    page.screenshot(path=SCREENSHOT, full_page=True)
    page.fill("#design-name", "designed tiny run")
    page.click("#launch")
    page.wait_for_url(re.compile(r"/runs/\d+/$"))
    run_id = int(re.search(r"/runs/(\d+)/$", page.url).group(1))
    expect(page.locator("h1")).to_contain_text("designed tiny run")

    stored = page.evaluate("async (id) => (await fetch(`/api/runs/${id}`)).json()", run_id)
    assert stored["config"]["model"]["dim"] == 64 and stored["config"]["parallel"]["dp_replicate"] == 2
    assert stored["config"]["compute"]["precision"] == "fp32" and stored["config"]["steps"] == 3
    assert stored["estimate"]["cluster"]["gpu"] == "H100-SXM"
    expect(page.locator("#predicted-memory")).not_to_be_empty()
    expect(page.locator("#predicted-tokens")).not_to_be_empty()

    expect(page.locator("#run-state")).to_have_text("succeeded", timeout=TRAINING_TIMEOUT_MS)
    expect(page.locator("#measured-memory")).to_have_text(re.compile(r"\d+\.\d+ (MiB|GiB)"))
    expect(page.locator("#measured-tokens")).to_have_text(re.compile(r"\d"))
    measured = page.evaluate("window.loomRun.measured")
    assert measured["peakMemoryBytes"] > 0 and sorted(measured["tokensPerSByRank"]) == ["0", "1"]
    page.screenshot(path=RUN_SCREENSHOT, full_page=True)


def mixtral_peak_bytes(page) -> float:
    """Loads the Mixtral 8x7B preset; its estimated peak memory."""
    page.select_option("#design-preset", "mixtral-8x7b")
    wait_for_estimate(page, "estimate.config.model.experts === 8")
    return page.evaluate("window.loomDesign.estimate.memory.peak_bytes")


def test_a_mixture_of_experts_can_keep_its_first_blocks_dense_and_a_preset_sets_them_back(designer):
    page = designer
    experts_only = mixtral_peak_bytes(page)
    # DeepSeek-V3's first blocks: dense, and wider than an expert.
    set_field(page, "model.moe.dense_layers", "3")
    set_field(page, "model.moe.dense_ffn", "28672")
    wait_for_estimate(page, "estimate.config.model.moe.dense_layers === 3 && estimate.config.model.moe.dense_ffn")
    expect(page.locator("#design-preset")).to_have_value("")
    # Three dense blocks hold far less than three of eight experts each.
    assert page.evaluate("window.loomDesign.estimate.memory.peak_bytes") < experts_only
    set_field(page, "model.moe.dense_layers", "32")
    expect(field_error(page, "model.moe.dense_layers")).to_contain_text("below model.layers=32")
    page.select_option("#design-preset", "mixtral-8x7b")
    expect(page.locator('[data-path="model.moe.dense_layers"]')).to_have_value("0")
    expect(page.locator('[data-path="model.moe.dense_ffn"]')).to_have_value("")
    wait_for_estimate(page, "estimate.config.model.moe.dense_layers === 0")
    expect(page.locator("#design-preset")).to_have_value("mixtral-8x7b")


def test_a_mixture_of_experts_routing_is_set_in_the_designer(designer):
    """DeepSeek-V3's routing: sigmoid gates, bias balancing without the auxiliary loss; a capacity, and back to
    dropless with the field emptied."""
    page = designer
    with_balance_loss = mixtral_peak_bytes(page)
    set_field(page, "model.moe.gate", "sigmoid")
    set_field(page, "model.moe.balance_loss", "0")
    set_field(page, "model.moe.bias_update_rate", "0.001")
    set_field(page, "model.moe.capacity_factor", "1.25")
    routed = "estimate.config.model.moe"
    wait_for_estimate(
        page,
        f"{routed}.gate === 'sigmoid' && {routed}.balance_loss === 0 && {routed}.bias_update_rate === 0.001"
        f" && {routed}.capacity_factor === 1.25",
    )
    # Without the balance loss the router keeps no affinity sums for it.
    assert page.evaluate("window.loomDesign.estimate.memory.peak_bytes") < with_balance_loss
    set_field(page, "model.moe.capacity_factor", "-1")
    expect(field_error(page, "model.moe.capacity_factor")).to_contain_text("greater than 0")
    set_field(page, "model.moe.capacity_factor", "")
    wait_for_estimate(page, "estimate.config.model.moe.capacity_factor === null")
    expect(field_error(page, "model.moe.capacity_factor")).to_be_hidden()
