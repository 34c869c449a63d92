"use strict";
// The run page's Experts panel, on runs whose model is a mixture of experts: for the chosen layer, a heatmap
// of each expert's share of the layer's routed tokens per step, and the load imbalance (the busiest expert's
// tokens over the mean expert's) per step. It loads the metrics API's expert load for one layer, sized to the
// chart's width (a zoom asks for that range at full resolution; a double-click goes back to the whole run), and
// is kept live by the metric events run.js applies: the trainer's carry `experts`, one rank per pipeline stage
// for the layers its stage holds.
//
// An answer holds every event up to its last_seq, so an event is applied only when its seq is after that. A
// step is one column while the columns fit the chart: a live step is patched in. A column of several steps is
// a sum the page cannot extend from events, so such an answer, and one a live step would make too wide, is
// fetched again instead. Live redraws and refetches come at most every REFETCH_MS, or REFETCH_BACKOFF times
// the last fetch and draw, as the rank × step heatmap's do.

window.loomRunExperts = (page, run, requestFrame) => {
  const C = window.loomCharts;
  const REFETCH_MS = 2000;
  const REFETCH_BACKOFF = 50;
  const HEIGHT_MIN = 240;
  const HEIGHT_MAX = 720;
  // Pale for an expert's small share, dark for a large one: an expert the router favours is a dark row.
  const SHARE_COLOURS = [
    [0, "#f7fbff"],
    [0.5, "#6baed6"],
    [1, "#08306b"],
  ];

  const heatmapElement = document.getElementById("experts-heatmap");
  const imbalanceElement = document.getElementById("experts-imbalance-chart");
  const layerSelect = document.getElementById("experts-layer");
  const note = document.getElementById("experts-heatmap-note");

  // layer: the one chosen; answer: the metrics API's answer for `shownLayer`, patched by live steps; range: a
  // zoom, or null for the whole run.
  const panel = { layer: layerSelect.value, shownLayer: null, range: null, ticket: 0, answer: null, dirty: false };
  // The events applied while a fetch was in flight: those after its answer's last_seq are applied on top of it.
  let fetching = 0;
  let appliedMeanwhile = [];
  const times = { finishedAt: 0, tookMs: 0, drawMs: 0 };
  let refetchTimer = null;
  let refetchDue = false;
  let plotsCreated = false;
  let showError = () => {};

  // ---- the answer and live steps ----

  async function fetchExperts() {
    const ticket = (panel.ticket += 1);
    const layer = panel.layer;
    fetching += 1;
    const started = Date.now();
    try {
      const query = C.rangeQuery(C.plotWidth(heatmapElement), panel.range, { layers: layer });
      const answer = await C.getJson(`${page.apiUrl}/metrics/experts?${query}`);
      if (ticket !== panel.ticket) return answer.last_seq;
      panel.answer = answer;
      panel.shownLayer = layer;
      showLayers(answer.layers);
      for (const event of appliedMeanwhile) applyReport(event);
      panel.dirty = true;
      requestFrame();
      return answer.last_seq;
    } finally {
      fetching -= 1;
      if (!fetching) appliedMeanwhile = [];
      times.finishedAt = Date.now();
      times.tookMs = times.finishedAt - started;
    }
  }

  function showLayers(layers) {
    if (layerSelect.options.length === layers.length) return;
    layerSelect.replaceChildren(...layers.map((layer) => new Option(`${layer}`, layer)));
    layerSelect.value = panel.layer;
  }

  function applyMetric(event) {
    if (!event.payload.experts || event.attempt === null || event.step === null) return;
    if (fetching) appliedMeanwhile.push(event);
    applyReport(event);
  }

  function applyReport(event) {
    const answer = panel.answer;
    if (!answer || event.seq <= answer.last_seq) return;
    if (event.attempt > answer.attempt) {
      // A new attempt: the panel follows it, over its whole length.
      panel.range = null;
      scheduleRefetch();
      return;
    }
    const report = event.payload.experts[panel.shownLayer];
    if (event.attempt !== answer.attempt || !wellFormed(report, answer.experts) || !inRange(event.step)) return;
    if (!patch(answer, event.step, report)) scheduleRefetch();
    else scheduleDraw();
  }

  // A report the page can draw; the API leaves out the others too (a payload is stored as its rank sent it).
  function wellFormed(report, experts) {
    const load = report?.load;
    if (!Array.isArray(load) || load.length !== experts) return false;
    return load.every((tokens) => Number.isInteger(tokens) && tokens >= 0);
  }

  function inRange(step) {
    return panel.range === null || (step >= panel.range[0] && step <= panel.range[1]);
  }

  // The step's column from a live report; false when the answer cannot take it (a column of several steps, or
  // one column more than the chart has pixels).
  function patch(answer, step, report) {
    if (answer.span !== 1) return false;
    const layer = panel.shownLayer;
    const column = sortedPosition(answer.steps, step);
    if (answer.steps[column] !== step) {
      if (answer.steps.length >= C.plotWidth(heatmapElement)) return false;
      answer.steps.splice(column, 0, step);
      for (const name of ["load", "imbalance", "dropped", "balance_loss"]) answer[name][layer].splice(column, 0, null);
    }
    answer.load[layer][column] = report.load;
    answer.imbalance[layer][column] = imbalanceOf(report.load);
    answer.dropped[layer][column] = report.dropped;
    answer.balance_loss[layer][column] = report.balance_loss ?? null;
    return true;
  }

  // The busiest expert's tokens over the mean expert's, as the API computes it; null for a step that routed
  // nothing.
  function imbalanceOf(load) {
    const total = load.reduce((sum, tokens) => sum + tokens, 0);
    return total ? (Math.max(...load) * load.length) / total : null;
  }

  // The first index whose step is ≥ `step` (steps ascending).
  function sortedPosition(steps, step) {
    let low = 0;
    let high = steps.length;
    while (low < high) {
      const middle = (low + high) >> 1;
      if (steps[middle] < step) low = middle + 1;
      else high = middle;
    }
    return low;
  }

  function wait() {
    const cost = times.tookMs + times.drawMs;
    return Math.max(0, times.finishedAt + Math.max(REFETCH_MS, REFETCH_BACKOFF * cost) - Date.now());
  }

  function scheduleRefetch() {
    refetchDue = true;
    scheduleDraw();
  }

  function scheduleDraw() {
    if (refetchTimer !== null) return;
    refetchTimer = setTimeout(() => {
      refetchTimer = null;
      if (fetching) {
        scheduleDraw();
        return;
      }
      if (refetchDue) {
        refetchDue = false;
        fetchExperts().catch((error) => {
          showError(error);
          scheduleRefetch();
        });
        return;
      }
      panel.dirty = true;
      requestFrame();
    }, wait());
  }

  // ---- drawing ----

  // Each expert's share of the tokens its layer routed in each column: the columns of a long run sum
  // different numbers of tokens, and a share compares them.
  function shares(loads) {
    const experts = panel.answer.experts;
    const z = Array.from({ length: experts }, () => new Array(loads.length).fill(null));
    loads.forEach((load, column) => {
      const total = load ? load.reduce((sum, tokens) => sum + tokens, 0) : 0;
      if (!total) return;
      for (let expert = 0; expert < experts; expert += 1) z[expert][column] = load[expert] / total;
    });
    return z;
  }

  function draw() {
    if (!panel.dirty || !plotsCreated || !panel.answer) return;
    panel.dirty = false;
    const drawStarted = performance.now();
    const answer = panel.answer;
    const layer = panel.shownLayer;
    const loads = answer.load[layer];
    const z = shares(loads);
    const tokens = z.map((row, expert) => loads.map((load) => (load ? load[expert].toLocaleString("en-US") : "")));
    const steps = answer.span > 1 ? `${answer.span} steps from %{x}` : "step %{x}";
    const height = Math.min(HEIGHT_MAX, Math.max(HEIGHT_MIN, answer.experts * 12 + C.MARGIN.t + C.MARGIN.b));
    heatmapElement.style.height = `${height}px`;
    const uirevision = `${answer.attempt}-${layer}`;
    Plotly.react(
      heatmapElement,
      [
        {
          type: "heatmap",
          x: [...answer.steps],
          y: Array.from({ length: answer.experts }, (_, expert) => expert),
          z,
          text: tokens,
          zmin: 0,
          colorscale: SHARE_COLOURS,
          colorbar: { title: { text: "share" }, tickformat: ".0%", thickness: 12 },
          hoverongaps: false,
          hovertemplate: `expert %{y} · ${steps}: %{z:.1%} of the tokens (%{text})<extra></extra>`,
        },
      ],
      {
        height,
        margin: { ...C.MARGIN, r: 8 },
        // No zero lines: Plotly draws them through the cells of expert 0.
        xaxis: { title: { text: "step" }, zeroline: false },
        yaxis: {
          title: { text: "expert" },
          autorange: "reversed",
          dtick: Math.max(1, Math.ceil(answer.experts / 16)),
          zeroline: false,
        },
        uirevision,
      },
      C.PLOT_CONFIG,
    );
    const imbalance = answer.imbalance[layer];
    const empty = answer.steps.length ? "" : "no expert load reported yet";
    Plotly.react(
      imbalanceElement,
      [
        {
          type: "scatter",
          mode: answer.steps.length > 1 ? "lines" : "markers",
          name: `layer ${layer}`,
          x: [...answer.steps],
          y: [...imbalance],
          line: { color: C.COLOURS[0], width: 1.5 },
          hovertemplate: `${steps}: %{y:.2f} × the mean<extra></extra>`,
        },
      ],
      {
        margin: C.MARGIN,
        xaxis: { title: { text: "step" }, visible: !empty },
        yaxis: { title: { text: "max / mean load" }, visible: !empty },
        showlegend: false,
        uirevision,
        annotations: empty ? [{ text: empty, showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5 }] : [],
      },
      C.PLOT_CONFIG,
    );
    note.textContent =
      `attempt ${answer.attempt}, layer ${layer}: top ${answer.top_k} of ${answer.experts} experts per token` +
      (answer.span > 1 ? `, each column the sum of ${answer.span} steps` : "") +
      (empty ? `; ${empty}` : "");
    times.drawMs = performance.now() - drawStarted;
    times.finishedAt = Date.now();
    run.panels.experts = { attempt: answer.attempt, layer, span: answer.span, steps: answer.steps.length };
  }

  // ---- CSV: the numbers drawn ----

  function heatmapTable() {
    const answer = panel.answer;
    const rows = [];
    if (answer) {
      const loads = answer.load[panel.shownLayer];
      const z = shares(loads);
      answer.steps.forEach((step, column) => {
        if (!loads[column]) return;
        loads[column].forEach((tokens, expert) => rows.push([step, expert, tokens, z[expert][column]]));
      });
    }
    return { columns: ["step", "expert", "tokens", "share"], rows };
  }

  function imbalanceTable() {
    const answer = panel.answer;
    const rows = answer ? answer.steps.map((step, column) => [step, answer.imbalance[panel.shownLayer][column]]) : [];
    return { columns: ["step", "imbalance"], rows };
  }

  // ---- wiring ----

  function zoomed(range) {
    panel.range = range;
    fetchExperts().catch(showError);
  }

  function createPlots() {
    for (const element of [heatmapElement, imbalanceElement]) {
      Plotly.newPlot(element, [], { margin: C.MARGIN }, C.PLOT_CONFIG);
      C.onStepRange(element, zoomed);
    }
    plotsCreated = true;
    requestFrame();
  }

  function setUp(onError) {
    showError = onError;
    const card = (element) => element.closest(".chart-card");
    const filename = (what) => () => `run-${page.runId}-layer-${panel.shownLayer}-${what}.csv`;
    C.addCsvButton(card(heatmapElement), filename("expert-load"), heatmapTable);
    C.addCsvButton(card(imbalanceElement), filename("imbalance"), imbalanceTable);
    layerSelect.addEventListener("change", () => {
      panel.layer = layerSelect.value;
      fetchExperts().catch(showError);
    });
    // Plotly is loaded `async` on this page (run_charts.js says why): the plots are created once it has run.
    if (window.Plotly) createPlots();
    else document.getElementById("plotly-script").addEventListener("load", createPlots);
  }

  // The snapshot: resolves to the answer's last_seq, up to which it holds every event.
  function loadSnapshot() {
    return fetchExperts();
  }

  return { setUp, loadSnapshot, applyMetric, draw };
};
