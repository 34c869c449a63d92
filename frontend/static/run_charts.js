"use strict";
// The run page's charts: run-level curves, step time and memory per rank, the rank × step heatmap
// and the rank × rank communication matrix beside the planner's. None of them is built from the raw
// events of a run (a 1,024-rank run has millions): each loads the metrics API sized to its width in
// pixels, asks again for a step range when the user zooms (a double-click goes back to the whole
// run), and is kept live by the metric events run.js applies after the snapshot's last_seq.
//
// A point can be both in an answer and in an event after it (the answer's rows are read after its
// last_seq), so events are merged by (attempt, rank, step): a step an answer already covers is not
// drawn twice. An answer that lands while events are being applied replaces what those events drew,
// so the events applied while a request was in flight are kept and applied again on top of it.

window.loomRunCharts = (page, run, requestFrame) => {
  const C = window.loomCharts;
  // Enough for a minute of a 1,024-rank run's step-time points.
  const LATENCIES_KEPT = 100000;
  // The rank whose tokens/s times the data-parallel degree is the run's (the API takes the lowest
  // reporting rank's, which is rank 0 whenever it reports).
  const TOKENS_RANK = 0;
  // The heavy rank-level panels (the heatmap, the traffic matrix) are redrawn at most this often...
  const REFETCH_MS = 2000;
  // ...and wait at least this many times as long as their last fetch and draw took: a page on a loaded
  // server, or of a world whose answers are large, asks and redraws less often by itself. Live points
  // arriving while a heavy chart is fetched or drawn wait for it: at 1,024 ranks a heatmap redraw holds
  // the page's thread ~100 ms, and with redraws taking a twentieth of the time, 40–66 % of the points
  // over the p95 emit → drawn had waited behind one (against 8–14 % of all points); at a fiftieth,
  // 13–33 % (against 3–4 %).
  const REFETCH_BACKOFF = 50;
  const RANK_LINES_MAX = 32;
  const HEATMAP_CLIP = 0.99;
  // Rank × bucket cells one heatmap answer holds at most (the chart API's CELLS_MAX).
  const HEATMAP_CELLS_MAX = 256 * 1024;
  const HEATMAP_REFRESHED_COLUMNS = 4;
  const HEATMAP_HEIGHT_MIN = 420;
  const HEATMAP_HEIGHT_MAX = 1100;
  const KINDS = ["tp", "cp", "ep", "dp", "pp"];
  const BAND_FILL = "rgba(48, 86, 211, 0.15)";
  const ACCENT = "#3056d3";

  // `on`: a series drawn on another's chart (validation loss beside training loss), not a chart of its own.
  const SERIES = {
    loss: { metric: "loss_mean", element: "loss-chart", axis: "loss (mean over ranks)", hover: "%{y:.4f}" },
    eval_loss: { metric: "eval_loss", on: "loss", name: "validation", hover: "%{y:.4f} validation" },
    grad_norm: { metric: "grad_norm", element: "grad-norm-chart", axis: "gradient norm", hover: "%{y:.4f}" },
    lr: { metric: "lr", element: "lr-chart", axis: "learning rate", hover: "%{y:.3e}" },
    tokens_per_s: { metric: "tokens_per_s", element: "tokens-chart", axis: "tokens/s, all ranks", hover: "%{y:,.0f}" },
    mfu: { metric: "mfu", element: "mfu-chart", axis: "MFU", hover: "%{y:.1%}", yaxis: { tickformat: ".0%" } },
  };
  // The charts, and per chart the series drawn on it (its own first).
  const CHARTS = Object.keys(SERIES).filter((key) => !SERIES[key].on);
  const DRAWN_ON = Object.fromEntries(
    CHARTS.map((chart) => [chart, Object.keys(SERIES).filter((key) => key === chart || SERIES[key].on === chart)]),
  );
  const chartOfSeries = (key) => SERIES[key].on || key;
  const RANK_METRICS = {
    step_time_s: {
      element: "step-time-chart",
      axis: "step time (s)",
      hover: "%{y:.3f} s",
      value: (payload) => payload.step_time_s,
    },
    memory_bytes: {
      element: "memory-chart",
      axis: "memory per rank",
      // Written in binary units per point (pointText) and on the axis (drawRanks): d3's formats know only SI.
      hover: "%{text}",
      bytes: true,
      // What the API projects: the CUDA allocator's bytes, or the resident set on CPUs.
      value: (payload) => payload.memory_allocated ?? payload.memory_rss,
    },
  };
  // Pale for fast, dark red for slow: a straggler is the darkest stripe.
  const SLOW_COLOURS = [
    [0, "#fff7ec"],
    [0.4, "#fdbb84"],
    [0.75, "#e34a33"],
    [1, "#7f0000"],
  ];
  const HEATMAP = {
    step_time_s: {
      unit: "s",
      hover: "%{z:.3f} s",
      colorscale: SLOW_COLOURS,
    },
    // The step minus its collectives: the rank the others wait for has the most.
    compute_s: {
      unit: "s",
      hover: "%{z:.3f} s own work",
      colorscale: SLOW_COLOURS,
    },
    memory_bytes: {
      unit: "bytes",
      hover: "%{text}",
      bytes: true,
      colorscale: [
        [0, "#f7fbff"],
        [0.5, "#6baed6"],
        [1, "#08306b"],
      ],
    },
  };

  // ---- what the page shows, exposed on window.loomRun for the tests ----

  run.series = Object.fromEntries(Object.keys(SERIES).map((key) => [key, {}]));
  // Emit → on screen, ms: of each loss point (a step's first report) and of every rank's step-time and
  // memory point.
  run.drawLatencies = [];
  run.rankDrawLatencies = [];
  run.memoryDrawLatencies = [];
  // Of the step-time points that came over the websocket, ms: emit → sent by the platform (ingest,
  // commit, coalescing), sent → received by the page, received → on screen.
  run.rankDrawStages = [];
  run.panels = { ranks: {}, heatmap: null, comm: null };

  const elements = {};
  const dirty = new Set();

  // ---- requests in flight and the events applied meanwhile ----

  let inFlight = 0;
  let appliedMeanwhile = [];

  function beginFetch() {
    inFlight += 1;
  }

  function endFetch() {
    inFlight -= 1;
    if (!inFlight) appliedMeanwhile = [];
  }

  // Events applied after the answer's last_seq are not in it: apply them again on top.
  function replay(lastSeq, applyOne) {
    for (const event of appliedMeanwhile) if (event.seq > lastSeq) applyOne(event);
  }

  // ---- the attempt and ranks the rank-level panels show ----

  const attemptSelect = document.getElementById("panel-attempt");
  const rankPick = document.getElementById("rank-pick");
  const rankPickError = document.getElementById("rank-pick-error");
  // null: follow the latest attempt; otherwise the attempt number the user chose.
  let chosenAttempt = null;
  let pickedRanks = null;
  let shownAttempt = null;
  let worldSize = page.ranks;
  const dataParallel = new Map();

  // ========================= run-level curves, one trace per attempt =========================

  const seriesIndex = Object.fromEntries(Object.keys(SERIES).map((key) => [key, {}]));
  // Per chart and attempt, the last step an answer downsampled: a live step up to it is inside a
  // bucket the answer already drew from (its first, lowest, highest and last point).
  const seriesCovered = Object.fromEntries(Object.keys(SERIES).map((key) => [key, {}]));
  const seriesRange = Object.fromEntries(Object.keys(SERIES).map((key) => [key, null]));
  const seriesTicket = Object.fromEntries(Object.keys(SERIES).map((key) => [key, 0]));
  // Rank 0's tokens/s of steps whose attempt's data-parallel degree is not known yet.
  const tokensWaiting = new Map();
  let latencyPending = [];

  function fillSeries(key, answer) {
    run.series[key] = {};
    seriesIndex[key] = {};
    seriesCovered[key] = {};
    for (const attempt of answer.attempts) {
      learnDataParallel(attempt.attempt, attempt.data_parallel);
      const curve = attempt.series[SERIES[key].metric];
      if (!curve || !curve.step.length) continue;
      const points = curve.step.map((step, index) => [step, curve.value[index]]);
      run.series[key][attempt.attempt] = points;
      seriesIndex[key][attempt.attempt] = new Map(points.map((point) => [point[0], point]));
      const steps = curve.step;
      const raw = steps[steps.length - 1] - steps[0] + 1 === steps.length;
      if (!raw) seriesCovered[key][attempt.attempt] = steps[steps.length - 1];
    }
    dirty.add(chartOfSeries(key));
  }

  async function fetchSeries(keys, range) {
    const tickets = keys.map((key) => (seriesTicket[key] += 1));
    beginFetch();
    try {
      const width = C.plotWidth(elements[keys[0]]);
      const answer = await C.getJson(`${page.apiUrl}/metrics/series?${C.rangeQuery(width, range)}`);
      keys.forEach((key, index) => {
        if (tickets[index] !== seriesTicket[key]) return;
        fillSeries(key, answer);
        replay(answer.last_seq, (event) => applySeriesEvent(event, [key]));
      });
      requestFrame();
      return answer.last_seq;
    } finally {
      endFetch();
    }
  }

  function applySeriesEvent(event, keys = Object.keys(SERIES)) {
    const { attempt, step, rank, payload } = event;
    if (attempt === null || step === null) return;
    for (const key of keys) {
      let value;
      if (key === "tokens_per_s") {
        if (rank !== TOKENS_RANK) continue;
        const raw = C.pointValue(payload.tokens_per_s);
        if (raw === null) continue;
        const degree = dataParallel.get(attempt);
        if (degree === undefined)
          (tokensWaiting.get(attempt) || tokensWaiting.set(attempt, new Map()).get(attempt)).set(step, raw);
        value = degree === undefined ? null : raw * degree;
      } else {
        value = C.pointValue(payload[SERIES[key].metric]);
        if (value === null) continue;
      }
      if (!addSeriesPoint(key, attempt, step, value)) continue;
      if (key === "loss" && inRange(seriesRange.loss, step)) latencyPending.push(pendingPoint(event));
      dirty.add(chartOfSeries(key));
      requestFrame();
    }
  }

  function inRange(range, step) {
    return range === null || (step >= range[0] && step <= range[1]);
  }

  // A step's point is the first one seen of it; steps arrive in order from a rank, but a retried batch
  // can land after a later one, so the point goes where its step belongs.
  function addSeriesPoint(key, attempt, step, value) {
    const index = (seriesIndex[key][attempt] ||= new Map());
    if (index.has(step) || step <= (seriesCovered[key][attempt] ?? -Infinity)) return false;
    const points = (run.series[key][attempt] ||= []);
    const point = [step, value];
    index.set(step, point);
    let position = points.length;
    while (position > 0 && points[position - 1][0] > step) position -= 1;
    points.splice(position, 0, point);
    return true;
  }

  // Once an attempt's layout is known, its waiting throughput points can be drawn.
  function learnDataParallel(attempt, degree) {
    if (dataParallel.get(attempt) === degree) return;
    dataParallel.set(attempt, degree);
    const waiting = tokensWaiting.get(attempt);
    if (!waiting) return;
    tokensWaiting.delete(attempt);
    for (const [step, raw] of waiting) {
      const point = seriesIndex.tokens_per_s[attempt]?.get(step);
      if (point && point[1] === null) point[1] = raw * degree;
    }
    dirty.add("tokens_per_s");
    requestFrame();
  }

  // A chart's traces: a line per attempt of each series drawn on it. An attempt whose ranks reported the
  // metric as missing at every step (MFU on CPU, validation loss of a run that never evaluates) has no line.
  // A series drawn on another's chart is dashed, with a marker per (sparse) point, in its attempt's colour.
  function seriesTraces(chart) {
    return DRAWN_ON[chart].flatMap((key) =>
      Object.keys(run.series[key])
        .map(Number)
        .sort((a, b) => a - b)
        .filter((attempt) => run.series[key][attempt].some((point) => point[1] !== null))
        .map((attempt, index) => {
          const points = run.series[key][attempt];
          const colour = C.COLOURS[index % C.COLOURS.length];
          const beside = key !== chart;
          const name = beside ? `${SERIES[key].name}, attempt ${attempt}` : `attempt ${attempt}`;
          return {
            x: points.map((point) => point[0]),
            y: points.map((point) => point[1]),
            name,
            type: "scatter",
            mode: beside ? "lines+markers" : points.length > 1 ? "lines" : "markers",
            line: { color: colour, width: beside ? 2 : 1.5, dash: beside ? "dash" : "solid" },
            marker: { color: colour, size: beside ? 6 : 4 },
            hovertemplate: `step %{x}: ${SERIES[key].hover}<extra>${name}</extra>`,
          };
        }),
    );
  }

  // A fresh layout each time; uirevision keeps a zoom the user chose across redraws.
  // Tick labels sit inside the margins: Plotly's default check that none overflows the chart measures
  // each label's box on every redraw, a forced layout of the page that was a tenth of a live band's draw.
  const TICKS = { ticklabeloverflow: "allow" };

  // `legend`: false for the bands, whose note names their lines (its layout is measured on every draw).
  // A chart with nothing to draw shows its note without axes: Plotly's default range for no data
  // (-1 to 4, -100 % to 400 % as MFU) means nothing.
  function lineLayout(axisTitle, empty, extra = {}, legend = true) {
    const shown = { visible: !empty };
    return {
      margin: C.MARGIN,
      xaxis: { title: { text: "step" }, ...TICKS, ...shown },
      yaxis: { title: { text: axisTitle }, ...TICKS, ...(extra.yaxis || {}), ...shown },
      legend: { orientation: "h", y: -0.25 },
      showlegend: legend,
      uirevision: "keep-zoom",
      annotations: empty
        ? [{ text: empty, showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5, font: { color: "#5f6b7a" } }]
        : [],
    };
  }

  function drawSeries(key) {
    const traces = seriesTraces(key);
    const empty = traces.length ? "" : key === "mfu" ? mfuAbsence() : "no steps yet";
    const layout = lineLayout(SERIES[key].axis, empty, SERIES[key]);
    const drawing = Plotly.react(elements[key], traces, layout, C.PLOT_CONFIG);
    if (key === "loss") {
      keepLatencies(drawing, latencyPending, run.drawLatencies, null);
      latencyPending = [];
    }
  }

  // Why the MFU chart is empty: the trainer measures MFU against the GPU's peak FLOP/s, which a CPU and
  // a GPU loom has no figures for lack.
  function mfuAbsence() {
    if (hardware === null) return "no MFU reported yet";
    if (hardware.onCpu) return "MFU is not measured on CPU";
    return `MFU is not measured on ${hardware.name} (its peak FLOP/s is unknown)`;
  }

  // The hardware of the latest attempt, from its ranks' "started" state events (run.js).
  let hardware = null;

  function showHardware(reported) {
    hardware = reported;
    dirty.add("mfu");
    requestFrame();
  }

  // The time from a rank's emit to its point on screen, for the end-to-end latency benchmark.
  function pendingPoint(event) {
    return { emitted: event.time * 1000, delivery: run.delivery };
  }

  function keepLatencies(drawing, pending, kept, stagesKept) {
    if (!pending.length) return;
    Promise.resolve(drawing).then(() => {
      const now = Date.now();
      for (const { emitted, delivery } of pending) {
        kept.push(now - emitted);
        if (stagesKept && delivery && typeof delivery.sent === "number") {
          const sent = delivery.sent * 1000;
          stagesKept.push([sent - emitted, delivery.received - sent, now - delivery.received, now]);
        }
      }
      for (const list of [kept, stagesKept || []]) {
        if (list.length > LATENCIES_KEPT) list.splice(0, list.length - LATENCIES_KEPT);
      }
    });
  }

  // ========================= step time and memory per rank =========================

  function rankPanel(metric) {
    return {
      metric,
      range: null,
      ticket: 0,
      attempt: null,
      span: 1,
      mode: "lines",
      // Lines: rank → {step, min, mean, max, end}: end is the last step the answer's buckets cover.
      lines: new Map(),
      // Band: {step, min, median, max, end} from the answer.
      band: null,
      // Band steps after the answer, from events: step → {values: Map(rank → value), summary}.
      live: new Map(),
      // The events this panel took since it was last drawn: their emit times and deliveries.
      latencyPending: [],
    };
  }

  const rankPanels = Object.fromEntries(Object.keys(RANK_METRICS).map((metric) => [metric, rankPanel(metric)]));

  function fillRanks(panel, answer) {
    panel.attempt = answer.attempt;
    panel.span = answer.span;
    panel.lines = new Map();
    panel.band = null;
    panel.live = new Map();
    // Replayed on top of the answer, events still waiting to be drawn would be counted twice.
    panel.latencyPending = [];
    const lastCovered = (steps) => (steps.length ? steps[steps.length - 1] + answer.span - 1 : -Infinity);
    if (answer.lines) {
      panel.mode = "lines";
      for (const [rank, line] of Object.entries(answer.lines)) {
        panel.lines.set(Number(rank), { ...line, end: lastCovered(line.step) });
      }
      // A rank asked for (or in an attempt of up to 8) that has reported nothing yet still gets a line.
      for (const rank of shownLineRanks(answer.world_size)) {
        if (!panel.lines.has(rank)) panel.lines.set(rank, { step: [], min: [], mean: [], max: [], end: -Infinity });
      }
    } else {
      panel.mode = "band";
      panel.band = { ...answer.band, end: lastCovered(answer.band.step) };
    }
    dirty.add(panel);
  }

  function shownLineRanks(world) {
    if (pickedRanks) return pickedRanks;
    return world <= 8 ? Array.from({ length: world }, (_, rank) => rank) : [];
  }

  async function fetchRanks(panel) {
    const ticket = (panel.ticket += 1);
    beginFetch();
    try {
      const query = C.rangeQuery(C.plotWidth(elements[panel.metric]), panel.range, {
        metric: panel.metric,
        attempt: chosenAttempt,
        ranks: pickedRanks ? pickedRanks.join(",") : "",
      });
      const answer = await C.getJson(`${page.apiUrl}/metrics/ranks?${query}`);
      if (ticket !== panel.ticket) return answer.last_seq;
      showAttempt(answer.attempt, answer.world_size);
      fillRanks(panel, answer);
      replay(answer.last_seq, (event) => applyRankEvent(panel, event));
      requestFrame();
      return answer.last_seq;
    } finally {
      endFetch();
    }
  }

  // The event's value of a per-rank metric; null when it has none (the server keeps finite values only).
  function rankValue(metric, event) {
    const raw = RANK_METRICS[metric].value(event.payload);
    const value = raw === undefined || raw === null ? NaN : Number(raw);
    return Number.isFinite(value) ? value : null;
  }

  function applyRankEvent(panel, event) {
    if (event.attempt !== panel.attempt || event.step === null || event.rank === null || event.rank < 0) return;
    const value = rankValue(panel.metric, event);
    if (value === null) return;
    const changed =
      panel.mode === "lines"
        ? addLinePoint(panel, event.rank, event.step, value)
        : addBandPoint(panel, event.rank, event.step, value);
    if (changed) {
      panel.latencyPending.push(pendingPoint(event));
      dirty.add(panel);
      requestFrame();
    }
  }

  function addLinePoint(panel, rank, step, value) {
    const line = panel.lines.get(rank);
    if (!line) return false;
    if (step > line.end || panel.span === 1) {
      const at = sortedPosition(line.step, step);
      if (line.step[at] === step) return false;
      for (const [name, item] of [
        ["step", step],
        ["min", value],
        ["mean", value],
        ["max", value],
      ]) {
        line[name].splice(at, 0, item);
      }
      return true;
    }
    // Inside a bucket of several steps the answer already summed: its extremes can only widen, and
    // they are the same whether or not the answer had counted this rank's step.
    return widenBucket(line, step, value);
  }

  // A band point after the answer is computed from the ranks seen so far and redrawn as more arrive.
  function addBandPoint(panel, rank, step, value) {
    if (step <= panel.band.end) return widenBucket(panel.band, step, value);
    let point = panel.live.get(step);
    if (!point) panel.live.set(step, (point = { values: new Map(), summary: null, complete: false }));
    if (point.complete || point.values.has(rank)) return false;
    point.values.set(rank, value);
    point.summary = null;
    return true;
  }

  function widenBucket(buckets, step, value) {
    const at = sortedPosition(buckets.step, step + 1) - 1;
    if (at < 0) return false;
    let changed = false;
    if (buckets.min[at] === null || value < buckets.min[at]) {
      buckets.min[at] = value;
      changed = true;
    }
    if (buckets.max[at] === null || value > buckets.max[at]) {
      buckets.max[at] = value;
      changed = true;
    }
    return changed;
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

  function summarize(values) {
    const sorted = [...values].sort((a, b) => a - b);
    const middle = sorted.length >> 1;
    const median = sorted.length % 2 ? sorted[middle] : (sorted[middle - 1] + sorted[middle]) / 2;
    return [sorted[0], median, sorted[sorted.length - 1]];
  }

  // The band as drawn: the answer's buckets, then the steps seen live.
  function bandData(panel) {
    const band = panel.band;
    const data = { step: [...band.step], min: [...band.min], median: [...band.median], max: [...band.max] };
    const liveSteps = [...panel.live.keys()].sort((a, b) => a - b);
    for (const step of liveSteps) {
      const point = panel.live.get(step);
      point.summary ||= summarize(point.values.values());
      data.step.push(step);
      data.min.push(point.summary[0]);
      data.median.push(point.summary[1]);
      data.max.push(point.summary[2]);
      // Every rank has reported the step: its summary is final and its values are no longer needed.
      if (point.values.size >= worldSize) {
        point.complete = true;
        point.values = new Map();
      }
    }
    return data;
  }

  function rankTraces(panel) {
    const spec = RANK_METRICS[panel.metric];
    if (panel.mode === "band") {
      const data = bandData(panel);
      const line = (name, values, extra) => ({
        x: data.step,
        y: values,
        ...pointText(spec, values),
        name,
        type: "scatter",
        mode: "lines",
        hovertemplate: `step %{x}: ${name} ${spec.hover}<extra></extra>`,
        ...extra,
      });
      return [
        line("max", data.max, { line: { color: ACCENT, width: 1 } }),
        line("min", data.min, { line: { color: ACCENT, width: 1 }, fill: "tonexty", fillcolor: BAND_FILL }),
        line("median", data.median, { line: { color: "#1d2330", width: 1.5 } }),
      ];
    }
    const across = panel.span > 1 ? ` (mean of ${panel.span} steps)` : "";
    return [...panel.lines.keys()]
      .sort((a, b) => a - b)
      .map((rank, index) => {
        const line = panel.lines.get(rank);
        return {
          x: line.step,
          y: line.mean,
          ...pointText(spec, line.mean),
          name: `rank ${rank}`,
          type: "scatter",
          mode: line.step.length > 1 ? "lines" : "markers",
          line: { color: C.COLOURS[index % C.COLOURS.length], width: 1.5 },
          hovertemplate: `rank ${rank} · step %{x}: ${spec.hover}${across}<extra></extra>`,
        };
      });
  }

  // Each point's value as its hover writes it, for a metric d3's number formats cannot write (bytes).
  function pointText(spec, values) {
    return spec.bytes ? { text: values.map(C.formatBytes) } : {};
  }

  // The y axis of a chart of bytes: ticks at round binary amounts over what the traces hold.
  function byteAxis(traces) {
    let low = Infinity;
    let high = -Infinity;
    for (const trace of traces) {
      for (const value of trace.y) {
        if (value === null || !Number.isFinite(value)) continue;
        low = Math.min(low, value);
        high = Math.max(high, value);
      }
    }
    // automargin: "1.005 GiB" is wider than the margin kept for the axis title.
    return low <= high ? { yaxis: { tickmode: "array", automargin: true, ...C.byteTicks(low, high) } } : {};
  }

  function drawRanks(panel) {
    const traces = rankTraces(panel);
    const hasPoints = traces.some((trace) => trace.x.length);
    const spec = RANK_METRICS[panel.metric];
    const note = document.getElementById(`${RANK_METRICS[panel.metric].element}-note`);
    const resolution = panel.span > 1 ? `${panel.span} steps per point` : "";
    const band = `shaded from min to max over ${worldSize} ranks, the dark line their median${resolution && `, ${resolution}`}`;
    note.textContent = panel.mode === "band" ? `${band}; pick ranks to see them as lines` : resolution;
    const drawing = Plotly.react(
      elements[panel.metric],
      traces,
      lineLayout(
        spec.axis,
        hasPoints ? "" : "no steps yet",
        spec.bytes ? byteAxis(traces) : spec,
        panel.mode !== "band",
      ),
      C.PLOT_CONFIG,
    );
    if (panel.metric === "step_time_s") {
      keepLatencies(drawing, panel.latencyPending, run.rankDrawLatencies, run.rankDrawStages);
    } else {
      keepLatencies(drawing, panel.latencyPending, run.memoryDrawLatencies, null);
    }
    panel.latencyPending = [];
    run.panels.ranks[panel.metric] = { attempt: panel.attempt, span: panel.span, mode: panel.mode };
  }

  function rankTable(panel) {
    if (panel.mode === "band") {
      const data = bandData(panel);
      return {
        columns: ["step", "min", "median", "max"],
        rows: data.step.map((step, index) => [step, data.min[index], data.median[index], data.max[index]]),
      };
    }
    const rows = [];
    for (const rank of [...panel.lines.keys()].sort((a, b) => a - b)) {
      const line = panel.lines.get(rank);
      line.step.forEach((step, index) => rows.push([rank, step, line.min[index], line.mean[index], line.max[index]]));
    }
    return { columns: ["rank", "step", "min", "mean", "max"], rows };
  }

  // ========================= rank × step heatmap =========================

  // While it follows the run one step per column, the heatmap is patched from live events: at 1,024
  // ranks a refetch took the page's server and the database 50–400 ms, every few seconds for every open
  // page, and the points arriving meanwhile waited behind it. Its redraws keep the pace a refetch had:
  // at most every REFETCH_MS, and less often when a redraw is slow (REFETCH_BACKOFF), as a 1,024-rank one
  // holds the page's thread for ~100 ms.
  // Columns of `span` > 1 steps are buckets of the tiles the server keeps, which events cannot extend (a
  // live step drawn as a one-step column beside them would give columns of different widths): such an
  // answer is fetched again. While it follows the run (no zoom), a refetch asks only for its last column
  // onwards at the span it shows: that column may have grown and new ones follow, and a 1,024-rank answer
  // stays a few columns instead of the whole run. Once the columns outgrow what one answer may hold, the
  // next answer is whole again, at the coarser span the server then picks.
  // following: the answer covers the whole run (it was asked for without a zoom).
  // stale: live steps arrived that the shown answer could not take.
  const heatmap = { metric: "step_time_s", range: null, ticket: 0, answer: null, following: false, stale: false };
  let heatmapTimer = null;
  const heatmapTimes = { name: "heatmap", finishedAt: 0, tookMs: 0, drawMs: 0 };
  let heatmapFetching = false;
  run.refetchCosts = { heatmap: heatmapTimes };
  // Each heavy answer's fetch and draw as [panel, "fetch" or "draw", start, end] (epoch ms), the latest
  // LATENCIES_KEPT: the latency benchmark tells by them which late points waited behind one.
  run.heavyWork = [];

  function noteHeavy(times, part, started) {
    run.heavyWork.push([times.name, part, started, Date.now()]);
    if (run.heavyWork.length > LATENCIES_KEPT) run.heavyWork.shift();
  }

  // The columns one whole answer holds at most (the server's rule); the answer that follows the run with
  // room for more columns, if any; and that answer if it has columns to extend by a refetch.
  function heatmapColumns(world) {
    return Math.max(1, Math.min(C.plotWidth(elements.heatmap), Math.floor(HEATMAP_CELLS_MAX / Math.max(1, world))));
  }

  function followingAnswer() {
    const shown = heatmap.answer;
    if (!shown || !heatmap.following || heatmap.range !== null || shown.metric !== heatmap.metric) return null;
    if (chosenAttempt !== null && shown.attempt !== chosenAttempt) return null;
    return shown.steps.length < heatmapColumns(shown.ranks.length) ? shown : null;
  }

  function extendable() {
    const shown = followingAnswer();
    return shown && shown.steps.length ? shown : null;
  }

  // The shown answer with its last column onwards replaced by the tail's; null when the tail does not fit
  // onto it (another attempt began, or the server chose otherwise).
  function extended(shown, tail) {
    if (tail.attempt !== shown.attempt || tail.span !== shown.span || tail.metric !== shown.metric) return null;
    if (!tail.steps.length) return { ...shown, last_seq: tail.last_seq, hosts: tail.hosts };
    const cut = shown.steps.indexOf(tail.steps[0]);
    if (cut < 0) return null;
    return {
      ...tail,
      steps: shown.steps.slice(0, cut).concat(tail.steps),
      z: shown.z.map((row, rank) => row.slice(0, cut).concat(tail.z[rank])),
    };
  }

  async function fetchHeatmap() {
    const ticket = (heatmap.ticket += 1);
    heatmapFetching = true;
    beginFetch();
    const started = Date.now();
    try {
      const shown = extendable();
      const params = { metric: heatmap.metric, attempt: chosenAttempt };
      // The last few columns again: ranks that lag behind the others fill them in late.
      const from = shown && shown.steps[Math.max(0, shown.steps.length - HEATMAP_REFRESHED_COLUMNS)];
      if (shown) Object.assign(params, { start: from, span: shown.span });
      const query = C.rangeQuery(C.plotWidth(elements.heatmap), heatmap.range, params);
      let answer = await C.getJson(`${page.apiUrl}/metrics/heatmap?${query}`);
      if (ticket !== heatmap.ticket) return answer.last_seq;
      if (shown) {
        answer = extended(shown, answer);
        if (answer === null) {
          heatmap.answer = null;
          return await fetchHeatmap();
        }
      }
      heatmap.answer = answer;
      heatmap.following = heatmap.range === null;
      replay(answer.last_seq, patchHeatmap);
      showAttempt(answer.attempt, answer.ranks.length);
      dirty.add("heatmap");
      requestFrame();
      return answer.last_seq;
    } finally {
      heatmapFetching = false;
      endFetch();
      timed(heatmapTimes, started);
    }
  }

  // A live metric event into the shown answer's cell: true when it changed the answer, false when it
  // brings nothing to draw, null when the answer cannot take it (buckets of several steps, a zoom,
  // another attempt, or one column more than an answer may hold).
  function patchHeatmap(event) {
    // An answer with no steps yet (a page opened before the run's first step) takes them too.
    const shown = followingAnswer();
    if (!shown || shown.span !== 1 || event.attempt !== shown.attempt) return null;
    if (event.step === null || event.rank === null || event.rank < 0 || event.rank >= shown.ranks.length) return false;
    const value = rankValue(heatmap.metric, event);
    if (value === null) return false;
    const column = sortedPosition(shown.steps, event.step);
    if (shown.steps[column] !== event.step) {
      shown.steps.splice(column, 0, event.step);
      for (const row of shown.z) row.splice(column, 0, null);
    }
    shown.z[event.rank][column] = value;
    return true;
  }

  function timed(times, started) {
    times.finishedAt = Date.now();
    times.tookMs = times.finishedAt - started;
    noteHeavy(times, "fetch", started);
  }

  function refetchWait(times) {
    const cost = times.tookMs + times.drawMs;
    return Math.max(0, times.finishedAt + Math.max(REFETCH_MS, REFETCH_BACKOFF * cost) - Date.now());
  }

  // A fetch before the next redraw: the shown answer could not take a live step.
  function scheduleHeatmap(step) {
    // A zoom the new step is outside of does not change with it.
    if (step !== undefined && !inRange(heatmap.range, step)) return;
    heatmap.stale = true;
    scheduleHeatmapUpdate();
  }

  function scheduleHeatmapUpdate() {
    if (heatmapTimer !== null) return;
    heatmapTimer = setTimeout(() => {
      heatmapTimer = null;
      if (heatmapFetching) {
        scheduleHeatmapUpdate();
        return;
      }
      if (waitUntilInView(elements.heatmap, scheduleHeatmapUpdate)) return;
      if (heatmap.stale) {
        heatmap.stale = false;
        fetchHeatmap().catch(() => scheduleHeatmap());
        return;
      }
      heatmapTimes.tookMs = 0;
      dirty.add("heatmap");
      requestFrame();
    }, refetchWait(heatmapTimes));
  }

  function hostOf(answer, rank) {
    return answer.hosts[rank] || "host unknown";
  }

  function drawHeatmap() {
    const answer = heatmap.answer;
    const spec = HEATMAP[heatmap.metric];
    const note = document.getElementById("rank-heatmap-note");
    if (!answer) return;
    const drawStarted = performance.now();
    const span = answer.span;
    const steps = span > 1 ? `${span} steps from %{x}` : "step %{x}";
    // The host of each cell's rank, for the hover: rows share one array per rank.
    const hosts = answer.ranks.map((rank) => new Array(answer.steps.length).fill(hostOf(answer, rank)));
    const range = colourRange(answer.z);
    const trace = {
      type: "heatmap",
      // Copies: live steps patch the answer's arrays, and the chart must keep what it drew.
      x: [...answer.steps],
      y: answer.ranks,
      z: answer.z.map((row) => row.slice()),
      customdata: hosts,
      ...(spec.bytes ? { text: answer.z.map((row) => row.map(C.formatBytes)) } : {}),
      ...range,
      colorscale: spec.colorscale,
      colorbar: {
        title: { text: spec.unit },
        thickness: 12,
        ...(spec.bytes && range.zmin !== undefined
          ? { tickmode: "array", ...C.byteTicks(range.zmin, range.zmax) }
          : {}),
      },
      hoverongaps: false,
      hovertemplate: `rank %{y} on %{customdata}<br>${steps}: ${spec.hover}<extra></extra>`,
    };
    const ranks = answer.ranks.length;
    // A pixel row per rank at least, up to 1,024 ranks: a straggler's row thinner than a pixel
    // could be skipped when the cells are painted.
    const height = Math.min(HEATMAP_HEIGHT_MAX, Math.max(HEATMAP_HEIGHT_MIN, ranks + C.MARGIN.t + C.MARGIN.b + 16));
    elements.heatmap.style.height = `${height}px`;
    const layout = {
      height,
      margin: { ...C.MARGIN, r: 8 },
      // No zero lines: Plotly draws them through the cells of rank 0 (and step 0).
      xaxis: { title: { text: "step" }, zeroline: false, ...TICKS },
      yaxis: {
        title: { text: "rank" },
        autorange: "reversed",
        dtick: Math.max(1, Math.ceil(ranks / 16)),
        zeroline: false,
        ...TICKS,
      },
      uirevision: `${heatmap.metric}-${answer.attempt}`,
    };
    Plotly.react(elements.heatmap, [trace], layout, C.PLOT_CONFIG);
    heatmapTimes.drawMs = performance.now() - drawStarted;
    // The next redraw waits from this one, whether a fetch or live steps brought it.
    heatmapTimes.finishedAt = Date.now();
    noteHeavy(heatmapTimes, "draw", heatmapTimes.finishedAt - heatmapTimes.drawMs);
    note.textContent =
      `attempt ${answer.attempt}, ${ranks} ranks` +
      (span > 1 ? `, each cell the mean of ${span} steps` : "") +
      (answer.steps.length ? "" : "; no steps yet");
    run.panels.heatmap = { attempt: answer.attempt, metric: heatmap.metric, span, steps: answer.steps.length };
  }

  // The colours span the lowest cell to the 99th percentile: one spike of one rank would otherwise
  // take the whole scale and leave a rank that is slow on every step a faint stripe. Cells above it
  // are drawn in the darkest colour; the hover shows every cell's own value.
  function colourRange(z) {
    // One pass into a typed array and a selection instead of flattening, filtering and sorting 256K cells:
    // that had been a quarter of a 1,024-rank heatmap's redraw, and live points wait behind a redraw.
    const values = new Float64Array(z.reduce((cells, row) => cells + row.length, 0));
    let count = 0;
    let low = Infinity;
    for (const row of z) {
      for (const value of row) {
        if (value === null || !Number.isFinite(value)) continue;
        values[count++] = value;
        if (value < low) low = value;
      }
    }
    if (!count) return {};
    const high = kthSmallest(values.subarray(0, count), Math.min(count - 1, Math.floor(count * HEATMAP_CLIP)));
    return high > low ? { zmin: low, zmax: high } : {};
  }

  // The k-th smallest of `values` (0-based), reordering them in place: Hoare's selection, linear on average.
  function kthSmallest(values, k) {
    let left = 0;
    let right = values.length - 1;
    while (left < right) {
      const pivot = values[(left + right) >> 1];
      let i = left;
      let j = right;
      while (i <= j) {
        while (values[i] < pivot) i += 1;
        while (values[j] > pivot) j -= 1;
        if (i <= j) {
          [values[i], values[j]] = [values[j], values[i]];
          i += 1;
          j -= 1;
        }
      }
      if (k <= j) right = j;
      else if (k >= i) left = i;
      else return values[k];
    }
    return values[k];
  }

  function heatmapTable() {
    const answer = heatmap.answer;
    const rows = [];
    if (answer) {
      answer.ranks.forEach((rank, row) => {
        answer.steps.forEach((step, column) => rows.push([rank, answer.hosts[rank], step, answer.z[row][column]]));
      });
    }
    return { columns: ["rank", "host", "step", heatmap.metric], rows };
  }

  // ========================= communication: measured beside predicted =========================

  const comm = { answer: null, ticket: 0, window: "", kind: "" };
  const commWindowSelect = document.getElementById("comm-window");
  const commKindSelect = document.getElementById("comm-kind");
  let commTimer = null;
  const commTimes = { name: "traffic", finishedAt: 0, tookMs: 0, drawMs: 0 };
  run.refetchCosts.comm = commTimes;
  let commDrawn = { measured: null, predicted: null };
  // What the predicted matrix on screen was drawn from: it is redrawn only when that changes (at 1,024
  // ranks a matrix costs tens of ms to draw, and the prediction of a layout never changes).
  let predictedDrawnFrom = null;

  async function fetchComm() {
    const ticket = (comm.ticket += 1);
    const started = Date.now();
    const query = new URLSearchParams();
    if (chosenAttempt !== null) query.set("attempt", String(chosenAttempt));
    const windows = comm.answer?.windows || [];
    if (comm.window === "all" && windows.length) {
      query.set("start", String(windows[0][0]));
      query.set("end", String(windows[windows.length - 1][1]));
    } else if (comm.window && comm.window !== "all") {
      const [first, last] = comm.window.split("-");
      query.set("start", first);
      query.set("end", last);
    }
    let answer;
    try {
      answer = await C.getJson(`${page.apiUrl}/comm?${query}`);
    } finally {
      timed(commTimes, started);
    }
    if (ticket !== comm.ticket) return;
    comm.answer = answer;
    showCommWindows(answer);
    dirty.add("comm");
    requestFrame();
  }

  function scheduleComm() {
    // A window the user picked does not change; "latest" and "all windows" do.
    if (commTimer !== null || (comm.window && comm.window !== "all")) return;
    commTimer = setTimeout(() => {
      commTimer = null;
      if (waitUntilInView(elements.commMeasured, scheduleComm)) return;
      fetchComm().catch(() => scheduleComm());
    }, refetchWait(commTimes));
  }

  function showCommWindows(answer) {
    const options = [new Option("latest window", ""), new Option("all windows", "all")];
    for (const [first, last] of [...answer.windows].reverse()) {
      options.push(new Option(first === last ? `step ${first}` : `steps ${first}–${last}`, `${first}-${last}`));
    }
    const chosen = comm.window;
    commWindowSelect.replaceChildren(...options);
    commWindowSelect.value = options.some((option) => option.value === chosen) ? chosen : "";
  }

  function rankLabel(first, block, world) {
    const last = Math.min(first + block, world) - 1;
    return block > 1 ? `ranks ${first}–${last}` : `rank ${first}`;
  }

  // log10 of bytes per step, so a tp link and a dp link a thousand times lighter both show; silent
  // cells are left blank. With a kind picked, each cell holds that kind's own bytes (a dp transfer is
  // shown also where tp traffic between the same ranks is heavier).
  function commMatrix(matrix, answer) {
    const { block, world_size: world } = answer;
    const side = matrix.bytes.length;
    const bytes = comm.kind ? Array.from({ length: side }, () => new Array(side).fill(0)) : matrix.bytes;
    if (comm.kind) {
      for (const [source, destination, value] of matrix.by_kind[comm.kind] || []) bytes[source][destination] = value;
    }
    const z = [];
    const text = [];
    const cells = [];
    bytes.forEach((row, source) => {
      const zRow = [];
      const textRow = [];
      row.forEach((value, destination) => {
        const kind = comm.kind || matrix.kind[source][destination];
        const shown = value > 0;
        zRow.push(shown ? Math.log10(value) : null);
        textRow.push(
          shown
            ? `${rankLabel(source * block, block, world)} → ${rankLabel(destination * block, block, world)}<br>` +
                `${C.formatBytes(value)} per step · ${kind || "unlabelled"}`
            : "",
        );
        if (shown) cells.push([source * block, destination * block, block, value, kind]);
      });
      z.push(zRow);
      text.push(textRow);
    });
    return { z, text, cells };
  }

  function drawComm() {
    const answer = comm.answer;
    if (!answer) return;
    const drawStarted = performance.now();
    const measured = commMatrix(answer.measured, answer);
    const predicted = answer.predicted ? commMatrix(answer.predicted, answer) : null;
    commDrawn = { measured: measured.cells, predicted: predicted ? predicted.cells : null };
    const logs = [measured, predicted].filter(Boolean).flatMap((matrix) => matrix.z.flat().filter((v) => v !== null));
    const low = logs.length ? Math.floor(Math.min(...logs)) : 0;
    const high = logs.length ? Math.max(low + 1, Math.ceil(Math.max(...logs))) : 1;
    const ticks = C.logByteTicks(low, high);
    const axisRanks = Array.from({ length: answer.measured.bytes.length }, (_, index) => index * answer.block);
    const trace = (matrix, showScale) => ({
      type: "heatmap",
      x: axisRanks,
      y: axisRanks,
      z: matrix.z,
      text: matrix.text,
      zmin: low,
      zmax: high,
      colorscale: [
        [0, "#e8edfb"],
        [0.5, "#7d95e6"],
        [1, "#172c7a"],
      ],
      showscale: showScale,
      colorbar: { title: { text: "bytes/step" }, tickmode: "array", ...ticks, thickness: 12 },
      hoverongaps: false,
      hovertemplate: "%{text}<extra></extra>",
    });
    const dtick = Math.max(1, Math.ceil(answer.world_size / 16 / answer.block)) * answer.block;
    const layout = (title) => ({
      margin: { l: 56, r: 8, t: 8, b: 44 },
      // No zero lines: Plotly draws them across the cell of ranks (0, 0).
      xaxis: { title: { text: "receiving rank" }, dtick, constrain: "domain", zeroline: false },
      yaxis: { title: { text: title }, dtick, autorange: "reversed", scaleanchor: "x", zeroline: false },
      uirevision: `comm-${answer.attempt}`,
    });
    Plotly.react(elements.commMeasured, [trace(measured, !predicted)], layout("sending rank"), C.PLOT_CONFIG);
    const predictedFrom = predicted && JSON.stringify([answer.attempt, comm.kind, answer.block, low, high]);
    if (predicted && predictedFrom !== predictedDrawnFrom)
      Plotly.react(elements.commPredicted, [trace(predicted, true)], layout("sending rank"), C.PLOT_CONFIG);
    else if (!predicted) Plotly.purge(elements.commPredicted);
    predictedDrawnFrom = predictedFrom;
    const window = answer.window ? `steps ${answer.window[0]}–${answer.window[1]} (${answer.steps} steps)` : "";
    document.getElementById("comm-measured-note").textContent = answer.windows.length
      ? `attempt ${answer.attempt}, ${window}${answer.block > 1 ? `, ${answer.block} ranks per cell` : ""}`
      : "no window measured yet: ranks send their traffic every telemetry.comm_window_steps steps";
    document.getElementById("comm-predicted-note").textContent = predicted
      ? `the planner's ring arithmetic for attempt ${answer.attempt}'s layout, one step`
      : `no prediction: ${answer.predicted_error}`;
    run.panels.comm = { attempt: answer.attempt, window: answer.window, block: answer.block, kind: comm.kind };
    commTimes.drawMs = performance.now() - drawStarted;
    noteHeavy(commTimes, "draw", Date.now() - commTimes.drawMs);
  }

  function commTable(which) {
    const cells = commDrawn[which] || [];
    return { columns: ["from_rank", "to_rank", "ranks_per_cell", "bytes_per_step", "kind"], rows: cells };
  }

  // ========================= the shown attempt, picking ranks =========================

  function showAttempt(attempt, ranks) {
    shownAttempt = attempt;
    worldSize = ranks;
  }

  function followedAttempt(event) {
    return chosenAttempt === null ? event.attempt >= (shownAttempt ?? 0) : event.attempt === chosenAttempt;
  }

  function refetchRankLevel() {
    for (const panel of Object.values(rankPanels)) fetchRanks(panel).catch(showError);
    fetchHeatmap().catch(showError);
    fetchComm().catch(showError);
  }

  let followTimer = null;

  // A new attempt's first metric moves the followed panels to it (once for a burst of events), at
  // its whole length and latest traffic window: a zoom or a window of the attempt before means nothing there.
  function followNewAttempt() {
    if (followTimer !== null) return;
    followTimer = setTimeout(() => {
      followTimer = null;
      forgetRanges();
      refetchRankLevel();
    }, 0);
  }

  function forgetRanges() {
    for (const panel of Object.values(rankPanels)) panel.range = null;
    heatmap.range = null;
    comm.window = "";
  }

  // "0, 5, 8-11": ranks to draw as lines; empty goes back to the default (lines up to 8 ranks, else a band).
  function parseRanks(text) {
    const ranks = new Set();
    for (const part of text
      .split(",")
      .map((item) => item.trim())
      .filter(Boolean)) {
      const match = /^(\d+)(?:\s*[-–]\s*(\d+))?$/.exec(part);
      if (!match) throw new Error(`"${part}" is not a rank or a range of ranks like 8-11`);
      const first = Number(match[1]);
      const last = match[2] === undefined ? first : Number(match[2]);
      if (last < first) throw new Error(`"${part}" runs backwards`);
      for (let rank = first; rank <= last; rank += 1) {
        if (rank >= worldSize) throw new Error(`rank ${rank} is not in this attempt's 0–${worldSize - 1}`);
        ranks.add(rank);
      }
    }
    if (ranks.size > RANK_LINES_MAX) throw new Error(`at most ${RANK_LINES_MAX} ranks as lines; ${ranks.size} picked`);
    return ranks.size ? [...ranks].sort((a, b) => a - b) : null;
  }

  function pickRanks() {
    try {
      pickedRanks = parseRanks(rankPick.value);
      rankPickError.hidden = true;
      rankPick.closest(".input")?.classList.remove("has-error");
    } catch (error) {
      rankPickError.textContent = error.message;
      rankPickError.hidden = false;
      rankPick.closest(".input")?.classList.add("has-error");
      return;
    }
    for (const panel of Object.values(rankPanels)) fetchRanks(panel).catch(showError);
  }

  // Clicking a heatmap cell adds its rank to the ranks drawn as lines.
  function pickFromHeatmap(click) {
    const rank = click.points?.[0]?.y;
    if (rank === undefined) return;
    const ranks = new Set(pickedRanks || []);
    ranks.add(Number(rank));
    rankPick.value = [...ranks].sort((a, b) => a - b).join(", ");
    pickRanks();
  }

  function attemptsChanged(detail) {
    for (const attempt of detail.attempts) {
      learnDataParallel(attempt.number, (attempt.parallel.dp_replicate ?? 1) * (attempt.parallel.dp_shard ?? 1));
    }
    const options = [new Option("latest", "")];
    for (const attempt of detail.attempts)
      options.push(new Option(`attempt ${attempt.number}`, String(attempt.number)));
    if (attemptSelect.options.length !== options.length) {
      attemptSelect.replaceChildren(...options);
      attemptSelect.value = chosenAttempt === null ? "" : String(chosenAttempt);
    }
  }

  let showError = () => {};

  // ========================= wiring =========================

  function card(element) {
    return element.closest(".chart-card");
  }

  // Plotly is loaded `async` on this page, so the snapshot's requests go out while its 4.8 MB is parsed
  // (most of a first visit's second here): the charts are created, and anything is drawn, once it has run.
  const plotlyLoaded = new Promise((resolve) => {
    if (window.Plotly) resolve();
    else document.getElementById("plotly-script").addEventListener("load", () => resolve());
  });
  let plotsCreated = false;

  function setUp(onError) {
    showError = onError;
    for (const key of CHARTS) {
      elements[key] = document.getElementById(SERIES[key].element);
      C.addCsvButton(card(elements[key]), `run-${page.runId}-${key}.csv`, () =>
        C.lineTable(seriesTraces(key), SERIES[key].metric),
      );
    }
    for (const [metric, spec] of Object.entries(RANK_METRICS)) {
      const panel = rankPanels[metric];
      elements[metric] = document.getElementById(spec.element);
      C.addCsvButton(
        card(elements[metric]),
        () => `run-${page.runId}-attempt-${panel.attempt}-${metric}-per-rank.csv`,
        () => rankTable(panel),
      );
    }
    elements.heatmap = document.getElementById("rank-heatmap");
    C.addCsvButton(
      card(elements.heatmap),
      () => `run-${page.runId}-attempt-${heatmap.answer?.attempt}-${heatmap.metric}-heatmap.csv`,
      heatmapTable,
    );
    for (const input of document.querySelectorAll('input[name="heatmap-metric"]')) {
      input.addEventListener("change", () => {
        heatmap.metric = input.value;
        heatmap.range = null;
        fetchHeatmap().catch(showError);
      });
    }
    elements.commMeasured = document.getElementById("comm-measured-chart");
    elements.commPredicted = document.getElementById("comm-predicted-chart");
    C.addCsvButton(
      card(elements.commMeasured),
      () => `run-${page.runId}-comm-measured.csv`,
      () => commTable("measured"),
    );
    C.addCsvButton(
      card(elements.commPredicted),
      () => `run-${page.runId}-comm-predicted.csv`,
      () => commTable("predicted"),
    );
    commWindowSelect.addEventListener("change", () => {
      comm.window = commWindowSelect.value;
      fetchComm().catch(showError);
    });
    commKindSelect.addEventListener("change", () => {
      comm.kind = commKindSelect.value;
      dirty.add("comm");
      requestFrame();
    });
    for (const chart of Object.values(elements)) viewWatcher.observe(chart);
    commKindSelect.replaceChildren(
      new Option("all kinds", ""),
      ...KINDS.map((kind) => new Option(`${kind} only`, kind)),
    );
    attemptSelect.addEventListener("change", () => {
      chosenAttempt = attemptSelect.value === "" ? null : Number(attemptSelect.value);
      forgetRanges();
      refetchRankLevel();
    });
    rankPick.addEventListener("change", pickRanks);
    plotlyLoaded.then(createPlots);
  }

  function createPlots() {
    for (const key of CHARTS) {
      Plotly.newPlot(elements[key], [], lineLayout(SERIES[key].axis, ""), C.PLOT_CONFIG);
      C.onStepRange(elements[key], (range) => {
        for (const drawn of DRAWN_ON[key]) seriesRange[drawn] = range;
        fetchSeries(DRAWN_ON[key], range).catch(showError);
      });
    }
    for (const [metric, spec] of Object.entries(RANK_METRICS)) {
      const panel = rankPanels[metric];
      Plotly.newPlot(elements[metric], [], lineLayout(spec.axis, ""), C.PLOT_CONFIG);
      C.onStepRange(elements[metric], (range) => {
        panel.range = range;
        fetchRanks(panel).catch(showError);
      });
    }
    Plotly.newPlot(elements.heatmap, [], { margin: C.MARGIN }, C.PLOT_CONFIG);
    C.onStepRange(elements.heatmap, (range) => {
      heatmap.range = range;
      fetchHeatmap().catch(showError);
    });
    elements.heatmap.on("plotly_click", pickFromHeatmap);
    plotsCreated = true;
    requestFrame();
  }

  // Everything the charts draw, from the API. Resolves to the lowest last_seq of the answers: every
  // event up to it is in them, and the events after it are applied on top (merged where they overlap).
  // The traffic matrix carries no seq (comm events only make it ask again) and, for a large world
  // with its predicted matrix, is the slowest answer: the page does not wait for it.
  async function loadSnapshot() {
    fetchComm().catch(showError);
    const seqs = await Promise.all([
      fetchSeries(Object.keys(SERIES), null),
      ...Object.values(rankPanels).map(fetchRanks),
      fetchHeatmap(),
    ]);
    return Math.min(...seqs);
  }

  function applyMetric(event) {
    if (inFlight) appliedMeanwhile.push(event);
    applySeriesEvent(event);
    if (event.attempt === null) return;
    if (chosenAttempt === null && shownAttempt !== null && event.attempt > shownAttempt) {
      // The answers it asks for take the place of what the panels hold, this event included.
      shownAttempt = event.attempt;
      followNewAttempt();
      return;
    }
    for (const panel of Object.values(rankPanels)) applyRankEvent(panel, event);
    if (!followedAttempt(event)) return;
    const patched = patchHeatmap(event);
    if (patched === null) scheduleHeatmap(event.step ?? undefined);
    else if (patched) scheduleHeatmapUpdate();
  }

  function applyComm(event) {
    if (event.attempt !== null && followedAttempt(event)) scheduleComm();
  }

  // ---- drawing what can be seen ----

  // A chart out of view is not redrawn as events arrive: at 1,024 ranks a redraw takes the page's one
  // thread for 10–80 ms, and a page has ten charts. Its data keeps up; it is drawn as it comes into view
  // (a margin ahead, so a scroll finds it drawn). Each chart is drawn once wherever it is, so a page
  // scrolled later never shows an empty one. The traffic matrix, and the heatmap when live steps cannot
  // patch it, are not fetched while out of view either: at 1,024 ranks an answer takes the server 50 ms
  // to 1 s, which the run's ingest and every other page wait behind.
  const outOfView = new Set();
  const drawnOnce = new Set();
  const refetchWhenInView = new Map();
  run.waitingForView = refetchWhenInView;
  const viewWatcher = new IntersectionObserver(
    (entries) => {
      for (const entry of entries) {
        if (!entry.isIntersecting) {
          outOfView.add(entry.target);
          continue;
        }
        outOfView.delete(entry.target);
        const refetch = refetchWhenInView.get(entry.target);
        refetchWhenInView.delete(entry.target);
        if (refetch) refetch();
      }
      requestFrame();
    },
    { rootMargin: "200px 0px" },
  );

  // True when `chart` waits out of view: `refetch` then runs as it comes into view.
  function waitUntilInView(chart, refetch) {
    if (!outOfView.has(chart) || !drawnOnce.has(chart)) return false;
    refetchWhenInView.set(chart, refetch);
    return true;
  }

  function chartOf(item) {
    if (typeof item === "object") return elements[item.metric];
    if (item === "comm") return elements.commMeasured;
    return elements[item];
  }

  // The heatmap and the traffic matrix hold the page's thread for tens of ms at 1,024 ranks; drawn in the
  // same frame as live points they would keep those points off the screen until they are done. They are
  // drawn in a frame of their own instead, one per frame, once no live point waits to be drawn.
  const HEAVY = new Set(["heatmap", "comm"]);

  function drawable(item) {
    const chart = chartOf(item);
    return !(outOfView.has(chart) && drawnOnce.has(chart));
  }

  function drawItem(item) {
    dirty.delete(item);
    drawnOnce.add(chartOf(item));
    if (typeof item === "object") drawRanks(item);
    else if (item === "heatmap") drawHeatmap();
    else if (item === "comm") drawComm();
    else drawSeries(item);
  }

  function draw() {
    if (!plotsCreated) return;
    const waiting = [...dirty].filter(drawable);
    const light = waiting.filter((item) => !HEAVY.has(item));
    const heavy = waiting.filter((item) => HEAVY.has(item));
    light.forEach(drawItem);
    if (!heavy.length) return;
    if (light.length) {
      requestFrame();
      return;
    }
    drawItem(heavy[0]);
    if (heavy.length > 1) requestFrame();
  }

  // The latest throughput and the highest memory the snapshot holds, for the predicted-vs-measured table.
  function snapshotFigures() {
    const attempts = Object.keys(run.series.tokens_per_s).map(Number);
    const latest = attempts.length ? run.series.tokens_per_s[Math.max(...attempts)] : [];
    const tokens = latest.length ? latest[latest.length - 1][1] : null;
    const memory = rankPanels.memory_bytes;
    const highs =
      memory.mode === "band" ? memory.band?.max || [] : [...memory.lines.values()].flatMap((line) => line.max);
    const finite = highs.filter((value) => Number.isFinite(value));
    return { tokensPerS: tokens, memoryBytes: finite.length ? Math.max(...finite) : null };
  }

  return { setUp, loadSnapshot, applyMetric, applyComm, attemptsChanged, draw, snapshotFigures, showHardware };
};
