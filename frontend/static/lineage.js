"use strict";
// The lineage page: a run's family (the run it was forked from, up to the root, and every run forked
// from any of them) drawn as SVG from the lineage API. Each run is a lane; each of its attempts a row
// spanning the steps from where it started to its last checkpoint, its checkpoints nodes on that row
// at their steps. Edges run from a checkpoint to the next one saved after it (its parent link), to an
// attempt that restarted or was restored from it, and to the first attempt of a run forked from it. An imported
// model the runs started from is a root above them, with an edge to each such run's first attempt.

(() => {
  const page = JSON.parse(document.getElementById("lineage-page").textContent);

  const SVG_NS = "http://www.w3.org/2000/svg";
  const MIN_WIDTH = 900;
  const LABEL_WIDTH = 220;
  const RIGHT_PAD = 56;
  const AXIS_HEIGHT = 40;
  const LANE_PAD = 12;
  const LANE_GAP = 8;
  const ROW_HEIGHT = 60;
  const BAR_TOP = 22;
  const BAR_HEIGHT = 18;
  const MIN_BAR_WIDTH = 16;
  const ATTEMPT_LABEL_WIDTH = 240;
  const NODE_RADIUS = 6;
  const STEP_LABEL_SPACING = 26;
  const AXIS_TICKS = 8;
  const EDGE_BEND = 36;
  const ARROW_SIZE = 9;
  const EDGE_KINDS = ["parent", "restart", "restore", "fork", "init"];
  const MODEL_LANE_HEIGHT = 48;
  const { formatBytes } = window.loom;

  const lineage = { data: null, ready: false };
  window.loomLineage = lineage;

  const graph = document.getElementById("lineage-graph");
  const status = document.getElementById("lineage-status");

  async function load() {
    try {
      const headers = { Accept: "application/json" };
      const response = await fetch(page.apiUrl, { credentials: "same-origin", headers });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      lineage.data = await response.json();
    } catch (error) {
      status.textContent = `Could not load the lineage (${error.message}).`;
      return;
    }
    draw();
    const { runs, attempts, checkpoints } = lineage.data;
    status.textContent = [
      count(runs.length, "run"),
      count(attempts.length, "attempt"),
      count(checkpoints.length, "checkpoint"),
    ].join(", ");
    lineage.ready = true;
    window.addEventListener("resize", draw);
  }

  // ---- geometry ----

  function layOut(data, width) {
    const checkpointById = new Map(data.checkpoints.map((checkpoint) => [checkpoint.id, checkpoint]));
    const startOf = (attempt) => checkpointById.get(attempt.restored_from)?.step ?? 0;
    const maxStep = Math.max(
      1,
      ...data.checkpoints.map((checkpoint) => checkpoint.step),
      ...data.attempts.map((attempt) => Math.max(startOf(attempt), attempt.last_step ?? 0)),
    );
    const plotWidth = width - LABEL_WIDTH - RIGHT_PAD;
    const x = (step) => LABEL_WIDTH + (step / maxStep) * plotWidth;

    const lanes = [];
    const rowOf = new Map();
    const modelNodes = new Map();
    let top = AXIS_HEIGHT;
    for (const model of data.models ?? []) {
      modelNodes.set(model.id, { model, top, x: x(0), y: top + MODEL_LANE_HEIGHT / 2 });
      top += MODEL_LANE_HEIGHT + LANE_GAP;
    }
    for (const run of data.runs) {
      const attempts = data.attempts.filter((attempt) => attempt.run === run.id).sort((a, b) => a.number - b.number);
      const height = 2 * LANE_PAD + Math.max(1, attempts.length) * ROW_HEIGHT;
      const rows = attempts.map((attempt, index) => {
        const rowTop = top + LANE_PAD + index * ROW_HEIGHT;
        const own = data.checkpoints.filter((checkpoint) => checkpoint.attempt === attempt.id);
        const start = startOf(attempt);
        // The last step it trained, which may lie past its last checkpoint (a crash, a run without saves).
        const end = Math.max(start, attempt.last_step ?? 0, ...own.map((checkpoint) => checkpoint.step));
        const row = {
          attempt,
          checkpoints: own,
          top: rowTop,
          centre: rowTop + BAR_TOP + BAR_HEIGHT / 2,
          x0: x(start),
          x1: Math.max(x(end), x(start) + MIN_BAR_WIDTH),
        };
        rowOf.set(attempt.id, row);
        return row;
      });
      lanes.push({ run, top, height, rows });
      top += height + LANE_GAP;
    }
    const nodeAt = (checkpoint) => ({ x: x(checkpoint.step), y: rowOf.get(checkpoint.attempt).centre });
    return { lanes, rowOf, modelNodes, checkpointById, nodeAt, x, maxStep, height: top };
  }

  // ---- drawing ----

  function draw() {
    const width = Math.max(MIN_WIDTH, graph.clientWidth);
    const geometry = layOut(lineage.data, width);
    const svg = svgElement("svg", { width, height: geometry.height, class: "lineage", role: "img" });
    svg.appendChild(svgElement("title")).textContent = `Lineage of run ${page.run}`;
    svg.appendChild(arrowMarkers());
    drawAxis(svg, geometry, width);
    for (const node of geometry.modelNodes.values()) drawModel(svg, node, width);
    for (const lane of geometry.lanes) drawLane(svg, lane, width);
    const edges = svg.appendChild(svgElement("g", { class: "lineage-edges" }));
    for (const edge of edgesOf(lineage.data, geometry)) edges.appendChild(edgePath(edge));
    for (const lane of geometry.lanes) {
      for (const row of lane.rows) drawCheckpoints(svg, row, geometry);
    }
    graph.replaceChildren(svg);
  }

  function drawAxis(svg, geometry, width) {
    const axis = svg.appendChild(svgElement("g", { class: "lineage-axis" }));
    const y = AXIS_HEIGHT - 10;
    axis.appendChild(svgElement("line", { x1: geometry.x(0), x2: width - RIGHT_PAD, y1: y, y2: y }));
    axis.appendChild(text("step", LABEL_WIDTH - 12, y + 4, { "text-anchor": "end" }));
    const every = niceStep(geometry.maxStep / AXIS_TICKS);
    for (let step = 0; step <= geometry.maxStep; step += every) {
      const x = geometry.x(step);
      axis.appendChild(svgElement("line", { x1: x, x2: x, y1: y - 4, y2: y }));
      axis.appendChild(text(String(step), x, y - 8, { "text-anchor": "middle" }));
    }
  }

  // 1, 2 or 5 times a power of ten, and a whole number of steps.
  function niceStep(raw) {
    const magnitude = 10 ** Math.floor(Math.log10(Math.max(raw, 1)));
    const nice = [1, 2, 5, 10].map((factor) => factor * magnitude).find((candidate) => candidate >= raw);
    return Math.max(1, nice);
  }

  // The imported model runs started from: a root at step 0, its source named beside it.
  function drawModel(svg, node, width) {
    const { model } = node;
    const group = svg.appendChild(svgElement("g", { class: "lineage-model", "data-model": model.id }));
    group.appendChild(svgElement("rect", { x: 0, y: node.top, width, height: MODEL_LANE_HEIGHT, rx: 8 }));
    group.appendChild(text(truncate(model.name, 28), 12, node.top + 20, { class: "lineage-run-title" }));
    group.appendChild(text(`imported model ${model.id}`, 12, node.top + 36, { class: "lineage-run-meta" }));
    const source = text(`from ${model.source_path}`, node.x + 2 * NODE_RADIUS, node.y + 4, { class: "lineage-run-meta" });
    group.appendChild(source);
    group.appendChild(svgElement("circle", { class: "lineage-model-mark", cx: node.x, cy: node.y, r: NODE_RADIUS }));
  }

  function drawLane(svg, lane, width) {
    const current = lane.run.id === page.run;
    const group = svg.appendChild(
      svgElement("g", {
        class: `lineage-lane${current ? " current" : ""}`,
        "data-run": lane.run.id,
        "data-current": String(current),
      }),
    );
    group.appendChild(svgElement("rect", { x: 0, y: lane.top, width, height: lane.height, rx: 8 }));
    const label = group.appendChild(svgElement("a", { href: `/runs/${lane.run.id}/`, class: "lineage-run-name" }));
    label.appendChild(text(truncate(lane.run.name, 28), 12, lane.top + 24, { class: "lineage-run-title" }));
    label.appendChild(svgElement("title")).textContent = lane.run.name;
    group.appendChild(text(`run ${lane.run.id} · ${lane.run.state}`, 12, lane.top + 42, { class: "lineage-run-meta" }));
    if (lane.run.forked_from !== null) {
      const origin = lineage.data.checkpoints.find((checkpoint) => checkpoint.id === lane.run.forked_from);
      if (origin) {
        const where = `forked from run ${origin.run} at step ${origin.step}`;
        group.appendChild(text(where, 12, lane.top + 58, { class: "lineage-run-meta" }));
      }
    }
    for (const row of lane.rows) group.appendChild(attemptBox(row, width));
  }

  function attemptBox(row, width) {
    const { attempt } = row;
    const link = svgElement("a", { href: `/runs/${attempt.run}/#attempt-${attempt.number}` });
    const box = link.appendChild(
      svgElement("g", {
        class: `lineage-attempt state-${attempt.state}`,
        "data-attempt-id": attempt.id,
        "data-run": attempt.run,
        "data-number": attempt.number,
        "data-state": attempt.state,
        "data-trigger": attempt.trigger,
      }),
    );
    box.appendChild(svgElement("title")).textContent = attemptDetails(attempt);
    // The label reads from the bar's start, or ends at its end where it would run off the right.
    const label = `attempt ${attempt.number} · ${attempt.state} · ${attempt.trigger}`;
    const fromStart = row.x0 + ATTEMPT_LABEL_WIDTH <= width;
    box.appendChild(
      text(label, fromStart ? row.x0 : row.x1, row.top + 15, { "text-anchor": fromStart ? "start" : "end" }),
    );
    box.appendChild(
      svgElement("rect", {
        x: row.x0,
        y: row.top + BAR_TOP,
        width: row.x1 - row.x0,
        height: BAR_HEIGHT,
        rx: 4,
      }),
    );
    return link;
  }

  function drawCheckpoints(svg, row, geometry) {
    let lastLabelX = -Infinity;
    for (const checkpoint of [...row.checkpoints].sort((a, b) => a.step - b.step)) {
      const { x, y } = geometry.nodeAt(checkpoint);
      const link = svg.appendChild(svgElement("a", { href: `/runs/${checkpoint.run}/#checkpoint-${checkpoint.id}` }));
      const node = link.appendChild(
        svgElement("g", {
          class: `lineage-checkpoint state-${checkpoint.state}`,
          "data-checkpoint": checkpoint.id,
          "data-run": checkpoint.run,
          "data-step": checkpoint.step,
          "data-state": checkpoint.state,
        }),
      );
      node.appendChild(svgElement("title")).textContent = checkpointDetails(checkpoint);
      const mark = `lineage-checkpoint-mark state-${checkpoint.state}`;
      node.appendChild(svgElement("circle", { cx: x, cy: y, r: NODE_RADIUS, class: mark }));
      if (checkpoint.state === "corrupt") {
        const arm = NODE_RADIUS * 0.6;
        const cross = `M${x - arm},${y - arm}L${x + arm},${y + arm}M${x - arm},${y + arm}L${x + arm},${y - arm}`;
        node.appendChild(svgElement("path", { d: cross, class: "lineage-corrupt-cross" }));
      }
      // Steps are labelled where there is room; the hover tells every node's.
      if (x - lastLabelX >= STEP_LABEL_SPACING) {
        const label = { "text-anchor": "middle", class: "lineage-step" };
        node.appendChild(text(String(checkpoint.step), x, y + BAR_HEIGHT + 4, label));
        lastLabelX = x;
      }
    }
  }

  // ---- edges ----

  function edgesOf(data, geometry) {
    const edges = [];
    for (const checkpoint of data.checkpoints) {
      const parent = geometry.checkpointById.get(checkpoint.parent);
      if (parent) {
        edges.push({
          kind: "parent",
          from: `checkpoint-${parent.id}`,
          to: `checkpoint-${checkpoint.id}`,
          start: geometry.nodeAt(parent),
          end: geometry.nodeAt(checkpoint),
        });
      }
    }
    const forkOrigin = new Map(data.runs.map((run) => [run.id, run.forked_from]));
    for (const lane of geometry.lanes) {
      lane.rows.forEach((row, index) => {
        const { attempt } = row;
        const model = geometry.modelNodes.get(lane.run.pretrained);
        if (index === 0 && model && lane.run.forked_from === null) {
          edges.push({
            kind: "init",
            from: `model-${model.model.id}`,
            to: `attempt-${attempt.id}`,
            start: { x: model.x, y: model.y },
            end: { x: row.x0, y: row.centre },
            intoAttempt: true,
          });
          return;
        }
        const forked = index === 0 && forkOrigin.get(attempt.run) !== null;
        const sourceId = forked ? forkOrigin.get(attempt.run) : attempt.restored_from;
        const source = geometry.checkpointById.get(sourceId);
        if (!source) return;
        edges.push({
          kind: forked ? "fork" : attempt.trigger === "restart" ? "restart" : "restore",
          from: `checkpoint-${source.id}`,
          to: `attempt-${attempt.id}`,
          start: geometry.nodeAt(source),
          end: { x: row.x0, y: row.centre },
          intoAttempt: true,
        });
      });
    }
    return edges;
  }

  // Along a row a straight line; between rows a curve leaving and arriving horizontally, which for an
  // attempt bends out to the left so its arrow enters the bar's start.
  function edgePath(edge) {
    const { start, end } = edge;
    let d;
    if (start.y === end.y && !edge.intoAttempt) {
      d = `M${start.x + NODE_RADIUS},${start.y}L${end.x - NODE_RADIUS},${end.y}`;
    } else if (edge.intoAttempt) {
      d =
        `M${start.x},${start.y + NODE_RADIUS}C${start.x - EDGE_BEND},${start.y + EDGE_BEND} ` +
        `${end.x - EDGE_BEND},${end.y} ${end.x - 2},${end.y}`;
    } else {
      const bend = Math.max(EDGE_BEND, (end.x - start.x) / 2);
      d =
        `M${start.x + NODE_RADIUS},${start.y}C${start.x + bend},${start.y} ` +
        `${end.x - bend},${end.y} ${end.x - NODE_RADIUS},${end.y}`;
    }
    return svgElement("path", {
      d,
      class: `lineage-edge edge-${edge.kind}`,
      "data-edge": edge.kind,
      "data-from": edge.from,
      "data-to": edge.to,
      "marker-end": `url(#arrow-${edge.kind})`,
    });
  }

  function arrowMarkers() {
    const defs = svgElement("defs");
    for (const kind of EDGE_KINDS) {
      const marker = defs.appendChild(
        svgElement("marker", {
          id: `arrow-${kind}`,
          viewBox: "0 0 10 10",
          refX: 9,
          refY: 5,
          markerWidth: ARROW_SIZE,
          markerHeight: ARROW_SIZE,
          // The same size on every edge, however thick its line.
          markerUnits: "userSpaceOnUse",
          orient: "auto-start-reverse",
          class: `lineage-arrow edge-${kind}`,
        }),
      );
      marker.appendChild(svgElement("path", { d: "M0,0L10,5L0,10z" }));
    }
    return defs;
  }

  // ---- what a hover shows ----

  function checkpointDetails(checkpoint) {
    const numbers = [`size ${formatBytes(checkpoint.bytes)}`];
    if (checkpoint.loss !== null) numbers.push(`loss ${checkpoint.loss.toFixed(4)}`);
    if (checkpoint.stall_s !== null) numbers.push(`training stalled ${formatSeconds(checkpoint.stall_s)}`);
    if (checkpoint.save_s !== null) numbers.push(`committed after ${formatSeconds(checkpoint.save_s)}`);
    const attempt = lineage.data.attempts.find((candidate) => candidate.id === checkpoint.attempt);
    const lines = [
      `step ${checkpoint.step} · ${checkpoint.state} (run ${checkpoint.run}, attempt ${attempt.number})`,
      checkpoint.path,
      numbers.join(" · "),
      `layout ${layoutText(checkpoint.layout)} on ${count(checkpoint.world_size, "rank")}`,
      `committed at ${new Date(checkpoint.committed_at).toLocaleString("sv-SE")}`,
    ];
    if (checkpoint.problem) lines.push(`problem: ${checkpoint.problem}`);
    return lines.join("\n");
  }

  function attemptDetails(attempt) {
    const ranks = count(attempt.world_size, "rank");
    const lines = [`attempt ${attempt.number} of run ${attempt.run} · ${attempt.state} · ${attempt.trigger}, ${ranks}`];
    if (attempt.trigger_note) lines.push(attempt.trigger_note);
    if (attempt.failure_kind || attempt.failure.length) {
      lines.push(`failure${attempt.failure_kind ? ` (${attempt.failure_kind})` : ""}: ${attempt.failure.join(" / ")}`);
    }
    if (attempt.restart_decision) lines.push(`restart decision: ${attempt.restart_decision}`);
    return lines.join("\n");
  }

  function layoutText(layout) {
    const degrees = ["dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"]
      .filter((degree) => layout[degree] > 1)
      .map((degree) => `${degree} ${layout[degree]}`);
    return degrees.join(" · ") || "1 rank";
  }

  // ---- small helpers ----

  function svgElement(name, attributes = {}) {
    const element = document.createElementNS(SVG_NS, name);
    for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, value);
    return element;
  }

  function text(content, x, y, attributes = {}) {
    const element = svgElement("text", { x, y, ...attributes });
    element.textContent = content;
    return element;
  }

  function truncate(value, length) {
    return value.length > length ? `${value.slice(0, length - 1)}…` : value;
  }

  function count(number, noun) {
    return `${number} ${noun}${number === 1 ? "" : "s"}`;
  }

  function formatSeconds(seconds) {
    if (seconds >= 10) return `${seconds.toFixed(0)} s`;
    if (seconds >= 1) return `${seconds.toFixed(1)} s`;
    if (seconds >= 0.01) return `${seconds.toFixed(2)} s`;
    return `${(seconds * 1000).toFixed(1)} ms`;
  }

  load();
})();
