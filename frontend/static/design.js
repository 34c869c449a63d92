"use strict";
// The designer page. The form is one run-config document plus a cluster; every edit asks the
// planner API for an estimate (debounced, and only the newest answer is drawn, since answers to
// earlier edits can arrive later), then for the predicted traffic. Errors and warnings are shown
// beside the field they name; what concerns the whole layout goes to the banner.

(() => {
  const page = JSON.parse(document.getElementById("design-page").textContent);

  const ESTIMATE_DEBOUNCE_MS = 250;
  const HEATMAP_MAX_RANKS = 1024;
  const GIB = 2 ** 30;
  const CLUSTER_PREFIX = "cluster.";
  const RUN_CONFIG_PREFIX = "config.";
  // Warnings about the layout as a whole rather than one input.
  const BANNER_WARNING = /^(memory|cluster)(\.|$)/;
  const OP_COLOURS = { F: "#3056d3", B: "#d9822b", "B+W": "#c6532b", W: "#23955a" };
  const OP_NAMES = { F: "forward", B: "backward (input)", "B+W": "backward (input + weight)", W: "backward (weight)" };
  const PLOT_CONFIG = { responsive: true, displaylogo: false };
  const CAPACITY_COLOUR = "#c62f3b";
  const HBM_COLOUR = "#6b7280";
  const FRAGMENTATION = "allocator fragmentation";
  // What Download names the file after, per export format.
  const EXPORT_FILES = { torchtitan: "loom-torchtitan.toml", megatron: "loom-megatron-args.txt" };

  const design = {
    estimate: null,
    lastRequest: null,
    errors: {},
    traffic: null,
    search: null,
    lastSearch: null,
    exported: null,
  };
  window.loomDesign = design;

  const form = document.getElementById("design-form");
  const presetSelect = document.getElementById("design-preset");
  const banner = document.getElementById("design-banner");
  const status = document.getElementById("design-status");
  const results = document.getElementById("design-results");
  const presets = Object.fromEntries(page.catalog.presets.map((preset) => [preset.name, preset.model]));

  // ---- the form as a document ----

  function pathInputs() {
    return [...form.querySelectorAll("[data-path]")];
  }

  function inputFor(path) {
    return form.querySelector(`[data-path="${path}"]`);
  }

  // Numbers go as numbers and switches as booleans; anything that does not parse goes as typed,
  // so the schema answers it with its own message. An empty optional select or number means null.
  function jsonValue(input) {
    const text = input.value.trim();
    if (input.dataset.type === "bool") return text === "true";
    if (input.dataset.type !== "number") return text;
    if (text === "" && (input.tagName === "SELECT" || "optional" in input.dataset)) return null;
    return numberOrText(text);
  }

  function numberOrText(text) {
    const number = Number(text);
    return text !== "" && Number.isFinite(number) ? number : text;
  }

  function formValue(value) {
    return value === null || value === undefined ? "" : String(value);
  }

  function currentRequest() {
    const request = { config: {}, cluster: {} };
    for (const input of pathInputs()) {
      const path = input.dataset.path;
      const [target, key] = path.startsWith(CLUSTER_PREFIX)
        ? [request.cluster, path.slice(CLUSTER_PREFIX.length)]
        : [request.config, path];
      setPath(target, key, jsonValue(input));
    }
    return request;
  }

  function setPath(target, path, value) {
    const parts = path.split(".");
    const last = parts.pop();
    for (const part of parts) target = target[part] ||= {};
    target[last] = value;
  }

  function getPath(source, path) {
    return path.split(".").reduce((value, part) => value?.[part], source);
  }

  // Loads a run config (a search result) into the form; the cluster and the steps stay as they are.
  function loadConfig(config) {
    for (const input of pathInputs()) {
      const path = input.dataset.path;
      if (path.startsWith(CLUSTER_PREFIX) || path === "steps") continue;
      const value = getPath(config, path);
      if (value !== undefined) input.value = formValue(value);
    }
    presetSelect.value = matchingPreset();
    scheduleEstimate();
  }

  function applyPreset() {
    const model = presets[presetSelect.value];
    if (!model) return;
    for (const [path, value] of presetInputs(model)) inputFor(path).value = formValue(value);
  }

  // [path, value] of each of a preset's fields that the form has an input for ("model.moe.dense_layers" too).
  function presetInputs(fields, prefix = "model") {
    return Object.entries(fields).flatMap(([field, value]) => {
      const path = `${prefix}.${field}`;
      if (value !== null && typeof value === "object") return presetInputs(value, path);
      return inputFor(path) ? [[path, value]] : [];
    });
  }

  // The preset whose fields the model inputs hold, or "" (custom).
  function matchingPreset() {
    const config = currentRequest().config;
    const matches = ([, fields]) => presetInputs(fields).every(([path, value]) => getPath(config, path) === value);
    const found = Object.entries(presets).find(matches);
    return found ? found[0] : "";
  }

  // ---- estimating ----

  let estimateTimer = null;
  let newestEstimate = 0;

  function scheduleEstimate() {
    clearTimeout(estimateTimer);
    estimateTimer = setTimeout(estimateNow, ESTIMATE_DEBOUNCE_MS);
  }

  async function estimateNow() {
    const request = currentRequest();
    const ticket = ++newestEstimate;
    design.lastRequest = request;
    showStatus("estimating…");
    let answer;
    try {
      answer = await postJson(page.urls.estimate, request);
    } catch (error) {
      if (ticket === newestEstimate) showStatus(`estimate failed: ${error.message}`);
      return;
    }
    if (ticket !== newestEstimate) return;
    if (answer.status === 400) {
      showInvalid(answer.body.errors);
      return;
    }
    design.estimate = answer.body;
    design.errors = {};
    results.classList.remove("stale");
    showMessages({}, answer.body.warnings);
    showStatus("");
    drawEstimate(answer.body);
    loadTraffic(request, answer.body.layout.world_size, ticket);
  }

  function showInvalid(errors) {
    design.errors = errors;
    results.classList.add("stale");
    showMessages(errors, []);
    showStatus("fix the marked fields to see an estimate");
  }

  async function loadTraffic(request, worldSize, ticket) {
    const note = document.getElementById("traffic-note");
    if (worldSize > HEATMAP_MAX_RANKS) {
      design.traffic = null;
      Plotly.purge("traffic-chart");
      note.textContent = `The heatmap is drawn for up to ${HEATMAP_MAX_RANKS} ranks; this layout has ${worldSize}.`;
      note.hidden = false;
      return;
    }
    let answer;
    try {
      answer = await postJson(page.urls.traffic, request);
    } catch (error) {
      if (ticket === newestEstimate) showStatus(`traffic failed: ${error.message}`);
      return;
    }
    if (ticket !== newestEstimate) return;
    if (answer.status === 400) {
      note.textContent = Object.values(answer.body.errors).join("; ");
      note.hidden = false;
      return;
    }
    note.hidden = true;
    design.traffic = answer.body;
    drawTraffic(answer.body);
  }

  // ---- messages beside fields and in the banner ----

  function showMessages(errors, warnings) {
    loom.clearFieldMessages(document);
    const bannerLines = [];
    for (const [field, message] of Object.entries(errors)) {
      if (!loom.placeFieldMessage(document, field, message, "field-error")) bannerLines.push(`${field}: ${message}`);
    }
    for (const { field, message } of warnings) {
      const placed = !BANNER_WARNING.test(field) && loom.placeFieldMessage(document, field, message, "field-warning");
      if (!placed) bannerLines.push(message);
    }
    banner.replaceChildren(...bannerLines.map(loom.listItem));
    banner.hidden = bannerLines.length === 0;
  }

  function showStatus(text) {
    status.textContent = text;
  }

  // ---- drawing an estimate ----

  function drawEstimate(estimate) {
    drawSummary(estimate);
    drawMemory(estimate.memory);
    drawTime(estimate.time);
    drawTimeline(estimate.timeline);
    drawTerms(estimate);
  }

  function drawSummary(estimate) {
    const { memory, layout } = estimate;
    const fits = document.getElementById("summary-fits");
    fits.textContent = memory.fits ? "fits" : "does not fit";
    fits.className = memory.fits ? "fits" : "does-not-fit";
    setText("summary-tokens", Math.round(estimate.tokens_per_s).toLocaleString("en-US"));
    setText("summary-mfu", percent(estimate.mfu));
    setText("summary-bubble", percent(estimate.bubble_fraction));
    setText("summary-step", formatSeconds(estimate.time.step_s));
    const passes = layout.accumulation_steps;
    const batch = `${layout.global_batch.toLocaleString("en-US")} sequences`;
    setText(
      "summary-batch",
      passes > 1
        ? `${batch}: ${passes} accumulation steps of ${layout.sequences_per_pass.toLocaleString("en-US")}`
        : `${batch}, no accumulation`,
    );
    setText("summary-peak", `${formatBinaryBytes(memory.peak_bytes)} of ${formatBinaryBytes(memory.usable_bytes)} usable`);
    setText("summary-headroom", formatBinaryBytes(memory.headroom_bytes));
    setText("summary-world", `${layout.world_size} of ${layout.gpus_in_cluster}`);
  }

  // One stack per pipeline rank, one trace per term name topped by what the allocator holds beyond
  // them, against two lines: what the allocator may use, and the GPU's memory above it (the CUDA
  // context and NCCL's buffers take the difference).
  function drawMemory(memory) {
    const ranks = memory.ranks.map((rank) => `pp rank ${rank.pp_rank}`);
    const names = [...new Set(memory.ranks.flatMap((rank) => rank.terms.map((term) => term.name)))];
    const termTraces = names.map((name) => {
      const terms = memory.ranks.map((rank) => rank.terms.find((term) => term.name === name));
      return {
        type: "bar",
        name,
        x: ranks,
        y: terms.map((term) => (term ? term.value / GIB : 0)),
        customdata: terms.map((term) => (term ? term.formula : "")),
        hovertemplate: "%{fullData.name}: %{y:.2f} GiB<br>%{customdata}<extra>%{x}</extra>",
      };
    });
    const fragmentation = {
      type: "bar",
      name: FRAGMENTATION,
      x: ranks,
      y: memory.ranks.map((rank) => (rank.reserved_bytes - rank.allocated_bytes) / GIB),
      marker: { color: "#cfd5df" },
      hovertemplate: "%{fullData.name}: %{y:.2f} GiB<br>blocks the caching allocator holds but cannot reuse<extra>%{x}</extra>",
    };
    const traces = [...termTraces, fragmentation];
    const capacity = memory.capacity_bytes / GIB;
    const usable = memory.usable_bytes / GIB;
    const outside = memory.outside_allocator.map((term) => `${term.name} ${formatBinaryBytes(term.value)}`).join(", ");
    const top = Math.max(capacity, ...memory.ranks.map((rank) => rank.reserved_bytes / GIB)) * 1.08;
    const layout = {
      barmode: "stack",
      margin: { l: 56, r: 16, t: 8, b: 40 },
      yaxis: { title: { text: "GiB" }, range: [0, top] },
      legend: { orientation: "h", y: -0.18 },
      hoverlabel: { namelength: -1 },
      shapes: [
        {
          type: "line", xref: "paper", x0: 0, x1: 1, y0: usable, y1: usable,
          line: { color: CAPACITY_COLOUR, dash: "dash" },
        },
        {
          type: "line", xref: "paper", x0: 0, x1: 1, y0: capacity, y1: capacity,
          line: { color: HBM_COLOUR, dash: "dot" },
        },
      ],
      annotations: [
        {
          xref: "paper", x: 1, y: usable, xanchor: "right", yanchor: "top", showarrow: false,
          text: `usable ${usable.toFixed(1)} GiB (less ${outside})`, font: { color: CAPACITY_COLOUR },
        },
        {
          xref: "paper", x: 1, y: capacity, xanchor: "right", yanchor: "bottom", showarrow: false,
          text: `HBM ${capacity.toFixed(1)} GiB`, font: { color: HBM_COLOUR },
        },
      ],
    };
    Plotly.react("memory-chart", traces, layout, PLOT_CONFIG);
  }

  function drawTime(time) {
    const traces = time.terms.map((term) => ({
      type: "bar",
      orientation: "h",
      name: term.name,
      y: ["step"],
      x: [term.value * 1000],
      customdata: [term.formula],
      hovertemplate: "%{fullData.name}: %{x:.2f} ms<br>%{customdata}<extra></extra>",
    }));
    const layout = {
      barmode: "stack",
      margin: { l: 48, r: 16, t: 8, b: 40 },
      xaxis: { title: { text: "ms" } },
      legend: { orientation: "h", y: -0.6 },
      hoverlabel: { namelength: -1 },
    };
    Plotly.react("time-chart", traces, layout, PLOT_CONFIG);
  }

  // Horizontal bars from each op's start to its end, one row per pipeline rank, one colour per kind.
  function drawTimeline(timeline) {
    const card = document.getElementById("timeline-card");
    if (!timeline) {
      Plotly.purge("timeline-chart");
      card.hidden = true;
      return;
    }
    card.hidden = false;
    const byKind = {};
    for (const op of timeline.ops) {
      const kind = op.k === "B" && op.w ? "B+W" : op.k;
      (byKind[kind] ||= []).push(op);
    }
    const traces = Object.entries(byKind).map(([kind, ops]) => ({
      type: "bar",
      orientation: "h",
      name: OP_NAMES[kind],
      y: ops.map((op) => op.r),
      base: ops.map((op) => op.t0 * 1000),
      x: ops.map((op) => (op.t1 - op.t0) * 1000),
      text: ops.map((op) => String(op.mb)),
      customdata: ops.map((op) => [op.s, op.t0 * 1000, op.t1 * 1000]),
      textposition: "inside",
      insidetextanchor: "middle",
      marker: { color: OP_COLOURS[kind], line: { color: "#fff", width: 0.5 } },
      hovertemplate:
        `${kind} stage %{customdata[0]}, microbatch %{text}<br>%{customdata[1]:.2f}–%{customdata[2]:.2f} ms` +
        "<extra>rank %{y}</extra>",
    }));
    const layout = {
      barmode: "overlay",
      bargap: 0.15,
      margin: { l: 56, r: 16, t: 28, b: 40 },
      title: { text: `${timeline.schedule}: bubble ${percent(timeline.bubble_fraction)}`, font: { size: 13 } },
      xaxis: { title: { text: "ms into the step" } },
      yaxis: { title: { text: "pipeline rank" }, autorange: "reversed", dtick: 1 },
      uniformtext: { mode: "hide", minsize: 8 },
      legend: { orientation: "h", y: -0.2 },
    };
    Plotly.react("timeline-chart", traces, layout, PLOT_CONFIG);
  }

  // Bytes in one binary unit, the busiest link's: Plotly's own suffixes would write 50 GB as "50G"
  // or "50B" (billions), which reads as 50 bytes.
  function drawTraffic(matrix) {
    const kinds = Object.entries(matrix.by_kind);
    const hover = matrix.bytes.map((row, source) =>
      row.map((total, destination) =>
        total
          ? kinds
              .filter(([, kindMatrix]) => kindMatrix[source][destination])
              .map(([kind, kindMatrix]) => `${kind} ${formatBinaryBytes(kindMatrix[source][destination])}`)
              .join(", ")
          : "",
      ),
    );
    const totals = matrix.bytes.map((row) => row.map(formatBinaryBytes));
    const unit = loom.byteUnit(Math.max(...matrix.bytes.flat()));
    const trace = {
      type: "heatmap",
      z: matrix.bytes.map((row) => row.map((bytes) => bytes / 1024 ** unit)),
      text: hover,
      customdata: totals,
      // Silence is the page's own background; the busiest link is the accent colour.
      colorscale: [[0, "#f6f7f9"], [1, "#3056d3"]],
      colorbar: { title: { text: loom.BYTE_UNITS[unit] }, exponentformat: "none" },
      hovertemplate: "rank %{y} → rank %{x}<br>%{customdata}: %{text}<extra></extra>",
    };
    // Whole ranks only, about 16 ticks however large the world.
    const dtick = Math.max(1, Math.ceil(matrix.world_size / 16));
    const layout = {
      margin: { l: 56, r: 16, t: 8, b: 44 },
      xaxis: { title: { text: "receiving rank" }, dtick, constrain: "domain" },
      yaxis: { title: { text: "sending rank" }, dtick, autorange: "reversed", scaleanchor: "x" },
    };
    Plotly.react("traffic-chart", [trace], layout, PLOT_CONFIG);
  }

  // The formulas behind every number: the time terms and the peak pipeline rank's memory terms.
  function drawTerms(estimate) {
    const peak = estimate.memory.ranks.find((rank) => rank.pp_rank === estimate.memory.peak_pp_rank);
    const rows = [
      ...estimate.time.terms.map((term) => termRow("step time", term, formatSeconds(term.value))),
      ...peak.terms.map((term) => termRow(`memory, pp rank ${peak.pp_rank}`, term, formatBinaryBytes(term.value))),
    ];
    document.getElementById("terms-rows").replaceChildren(...rows);
  }

  function termRow(part, term, value) {
    const row = document.createElement("tr");
    for (const text of [part, term.name, value, term.formula]) {
      row.appendChild(document.createElement("td")).textContent = text;
    }
    return row;
  }

  // ---- search ----

  async function runSearch() {
    const button = document.getElementById("search");
    const searchStatus = document.getElementById("search-status");
    const request = currentRequest();
    const precision = request.config.compute.precision;
    const body = {
      model: request.config.model,
      cluster: request.cluster,
      global_batch: numberOrText(document.getElementById("search-batch").value.trim()),
      precision: precision === "auto" ? "bf16" : precision,
      runnable_only: document.getElementById("search-runnable-only").checked,
    };
    design.lastSearch = body;
    button.disabled = true;
    searchStatus.textContent = "searching…";
    try {
      const answer = await postJson(page.urls.search, body);
      if (answer.status === 400) {
        showMessages(answer.body.errors, []);
        searchStatus.textContent = "fix the marked fields to search";
        return;
      }
      design.search = answer.body;
      const { evaluated, fitting, seconds, message } = answer.body;
      searchStatus.textContent =
        `${evaluated.toLocaleString("en-US")} layouts evaluated, ${fitting.toLocaleString("en-US")} fit, ` +
        `in ${seconds.toFixed(1)} s${message ? `: ${message}` : ""}`;
      drawSearchTable(answer.body.results);
      drawPareto(answer.body.results, answer.body.pareto);
    } catch (error) {
      searchStatus.textContent = `search failed: ${error.message}`;
    } finally {
      button.disabled = false;
    }
  }

  function drawSearchTable(found) {
    const rows = found.map((result) => {
      const row = document.createElement("tr");
      row.className = "search-result";
      row.tabIndex = 0;
      const cells = [result.rank, result.summary, Math.round(result.tokens_per_s).toLocaleString("en-US"),
                     percent(result.mfu), gib(result.peak_bytes), result.runnable ? "yes" : "not yet"];
      for (const text of cells) row.appendChild(document.createElement("td")).textContent = text;
      row.addEventListener("click", () => loadConfig(result.config));
      row.addEventListener("keydown", (event) => {
        if (event.key === "Enter") loadConfig(result.config);
      });
      return row;
    });
    document.getElementById("search-rows").replaceChildren(...rows);
    document.getElementById("search-table").hidden = found.length === 0;
  }

  let paretoListening = false;

  // Every result faded, the Pareto front (no layout both faster and smaller) on top; a click on
  // either loads that layout.
  function drawPareto(found, front) {
    const card = document.getElementById("pareto-card");
    card.hidden = found.length === 0;
    if (!found.length) return;
    const sortedFront = [...front].sort((a, b) => a.peak_bytes - b.peak_bytes);
    const traces = [
      resultsTrace(found, "ranked layouts", { mode: "markers", marker: { size: 8, color: "#b8c2d6" } }),
      resultsTrace(sortedFront, "Pareto front", { mode: "markers+lines", marker: { size: 10, color: "#3056d3" } }),
    ];
    const layout = {
      margin: { l: 70, r: 16, t: 8, b: 44 },
      xaxis: { title: { text: "peak memory per GPU (GiB)" } },
      yaxis: { title: { text: "tokens/s" } },
      legend: { orientation: "h", y: -0.25 },
      hovermode: "closest",
    };
    const chart = document.getElementById("pareto-chart");
    Plotly.react(chart, traces, layout, PLOT_CONFIG);
    // Plotly keeps a chart's listeners across react(): one listener reads the latest traces.
    if (!paretoListening) {
      chart.on("plotly_click", (event) => loadConfig(event.points[0].customdata));
      paretoListening = true;
    }
  }

  function resultsTrace(results, name, style) {
    return {
      type: "scatter",
      name,
      ...style,
      x: results.map((result) => result.peak_bytes / GIB),
      y: results.map((result) => result.tokens_per_s),
      text: results.map((result) => result.summary),
      customdata: results.map((result) => result.config),
      hovertemplate: "%{text}<br>%{x:.1f} GiB, %{y:,.0f} tokens/s<extra></extra>",
    };
  }

  // ---- launch and export ----

  async function launch() {
    const button = document.getElementById("launch");
    const request = currentRequest();
    const name = document.getElementById("design-name").value.trim() || layoutName(request.config);
    button.disabled = true;
    try {
      const config = withSources(request.config);
      const answer = await postJson(page.urls.runs, { name, config, cluster: request.cluster });
      if (answer.status === 201) {
        window.location.assign(`/runs/${answer.body.id}/`);
        return;
      }
      if (answer.status === 400) showMessages(runFieldErrors(answer.body.errors), []);
      else showStatus(`launch failed: HTTP ${answer.status}`);
    } catch (error) {
      showStatus(`launch failed: ${error.message}`);
    } finally {
      button.disabled = false;
    }
  }

  // ---- what the run trains on and starts from ----

  // The chosen dataset and starting weights, by reference; none chosen leaves the config's own (the demo corpus,
  // fresh weights). They change no estimate, so only a launch sends them.
  function withSources(config) {
    const dataset = document.getElementById("design-dataset").value;
    const initFrom = document.getElementById("design-init-from").value;
    const sourced = { ...config };
    if (dataset) sourced.data = { ...config.data, dataset };
    if (initFrom) sourced.checkpoint = { ...config.checkpoint, init_from: initFrom };
    return sourced;
  }

  // Starting weights fix the model's shape (all but the sequence length), and a dataset the least vocabulary.
  function applySources() {
    const model = page.sources.initModels[document.getElementById("design-init-from").value];
    if (model) {
      for (const [field, value] of Object.entries(model)) {
        const input = inputFor(`model.${field}`);
        if (input && field !== "seq_len") input.value = formValue(value);
      }
      presetSelect.value = matchingPreset();
    }
    const vocab = page.sources.datasetVocab[document.getElementById("design-dataset").value];
    const vocabInput = inputFor("model.vocab");
    if (vocab && vocabInput && Number(vocabInput.value) < vocab) vocabInput.value = String(vocab);
    scheduleEstimate();
  }

  // The runs API names config fields "config.model.experts"; the form names them "model.experts".
  function runFieldErrors(errors) {
    return Object.fromEntries(
      Object.entries(errors).map(([field, message]) => [
        field.startsWith(RUN_CONFIG_PREFIX) ? field.slice(RUN_CONFIG_PREFIX.length) : field,
        message,
      ]),
    );
  }

  function layoutName(config) {
    const degrees = ["dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"]
      .filter((degree) => config.parallel[degree] > 1)
      .map((degree) => `${degree} ${config.parallel[degree]}`);
    return [presetSelect.value || "custom model", ...degrees].join(" · ");
  }

  async function exportLayout() {
    const exportFormat = document.getElementById("export-format").value;
    const request = currentRequest();
    const answer = await postJson(page.urls.export, {
      config: request.config,
      cluster: request.cluster,
      format: exportFormat,
    });
    if (answer.status === 400) {
      showMessages(answer.body.errors, []);
      return;
    }
    design.exported = answer.body;
    document.getElementById("export-heading").textContent = `Export: ${exportFormat}`;
    document.getElementById("export-text").textContent = answer.body.text;
    const warnings = document.getElementById("export-warnings");
    warnings.replaceChildren(...answer.body.warnings.map(({ field, message }) => loom.listItem(`${field}: ${message}`)));
    warnings.hidden = answer.body.warnings.length === 0;
    setText("export-estimates", runtimeComparison(answer.body.estimates, exportFormat));
    setText("export-copy-status", "");
    const panel = document.getElementById("export-panel");
    panel.hidden = false;
    panel.scrollIntoView({ block: "nearest" });
  }

  // The same layout priced for the trainer it goes to, which fuses, overlaps and recomputes otherwise.
  function runtimeComparison(estimates, exportFormat) {
    const priced = (runtime) =>
      `${formatSeconds(runtime.step_s)} a step, ${Math.round(runtime.tokens_per_s).toLocaleString("en")} tokens/s, ` +
      `${formatBinaryBytes(runtime.peak_bytes)} peak${runtime.fits ? "" : " (does not fit)"}`;
    return `On ${exportFormat}: ${priced(estimates[exportFormat])}. On loom's trainer: ${priced(estimates.loom)}.`;
  }

  async function copyExport() {
    try {
      await navigator.clipboard.writeText(design.exported.text);
      setText("export-copy-status", "copied");
    } catch (error) {
      setText("export-copy-status", `copy failed (${error.message}): select the text instead`);
    }
  }

  function downloadExport() {
    const blob = new Blob([`${design.exported.text}\n`], { type: "text/plain" });
    const link = document.createElement("a");
    link.href = URL.createObjectURL(blob);
    link.download = EXPORT_FILES[design.exported.format];
    link.click();
    URL.revokeObjectURL(link.href);
  }

  // ---- small helpers ----

  async function postJson(url, body) {
    const response = await loom.post(url, body);
    if (![200, 201, 400].includes(response.status)) throw new Error(`HTTP ${response.status}`);
    return { status: response.status, body: await response.json() };
  }

  function setText(id, text) {
    document.getElementById(id).textContent = text;
  }

  function percent(fraction) {
    return `${(fraction * 100).toFixed(1)} %`;
  }

  function gib(bytes) {
    return (bytes / GIB).toFixed(1);
  }

  function formatSeconds(seconds) {
    if (seconds >= 1) return `${seconds.toPrecision(3)} s`;
    if (seconds >= 1e-3) return `${(seconds * 1e3).toPrecision(3)} ms`;
    return `${(seconds * 1e6).toPrecision(3)} µs`;
  }

  // Bytes in powers of two, memory and traffic alike; a negative headroom keeps its sign.
  function formatBinaryBytes(bytes) {
    const unit = loom.byteUnit(bytes);
    const value = bytes / 1024 ** unit;
    return `${value.toFixed(unit ? 1 : 0)} ${loom.BYTE_UNITS[unit]}`;
  }


  function start() {
    form.addEventListener("input", (event) => {
      if (event.target.dataset.path?.startsWith("model.")) presetSelect.value = matchingPreset();
      if (event.target.dataset.path) scheduleEstimate();
    });
    presetSelect.addEventListener("change", () => {
      applyPreset();
      scheduleEstimate();
    });
    form.addEventListener("submit", (event) => event.preventDefault());
    document.getElementById("launch").addEventListener("click", launch);
    document.getElementById("design-dataset").addEventListener("change", applySources);
    document.getElementById("design-init-from").addEventListener("change", applySources);
    document.getElementById("export").addEventListener("click", exportLayout);
    document.getElementById("export-copy").addEventListener("click", copyExport);
    document.getElementById("export-download").addEventListener("click", downloadExport);
    document.getElementById("search").addEventListener("click", runSearch);
    estimateNow();
  }

  start();
})();
