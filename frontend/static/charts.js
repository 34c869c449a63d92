"use strict";
// What the run page and the comparison page share about charts: how wide a chart is in pixels (the
// metrics API sizes its answers to it), following a user's zoom along the step axis so the page can
// ask for that range at full resolution, a CSV of exactly the numbers a chart draws, and number
// formats.

window.loomCharts = (() => {
  const PLOT_CONFIG = { responsive: true, displaylogo: false };
  const MARGIN = { l: 64, r: 16, t: 8, b: 44 };
  const MIN_WIDTH = 100;
  // The qualitative colours attempts and runs are drawn in (Plotly's default cycle, fixed here so a
  // run keeps its colour on every chart of the comparison page).
  const COLOURS = ["#3056d3", "#d9822b", "#23955a", "#c62f3b", "#7a5cd6", "#8c564b", "#e377c2", "#5f6b7a"];

  // The plot area's width: what a point per pixel means for this chart.
  function plotWidth(element, margin = MARGIN) {
    return Math.max(MIN_WIDTH, Math.round(element.clientWidth - margin.l - margin.r));
  }

  // A zoom along x calls back with [first step, last step]; a double-click (autorange) with null.
  // Zooming only along y says nothing about steps and is left to Plotly.
  function onStepRange(element, callback) {
    element.on("plotly_relayout", (change) => {
      if (change["xaxis.autorange"]) {
        callback(null);
        return;
      }
      const range = change["xaxis.range"] || [change["xaxis.range[0]"], change["xaxis.range[1]"]];
      if (range[0] === undefined || range[1] === undefined) return;
      const first = Math.max(0, Math.ceil(Number(range[0])));
      const last = Math.max(first, Math.floor(Number(range[1])));
      callback([first, last]);
    });
  }

  // The query string of a metrics request: the chart's width and, when zoomed, its step range.
  function rangeQuery(width, range, extra = {}) {
    const query = new URLSearchParams({ width: String(width) });
    if (range) {
      query.set("start", String(range[0]));
      query.set("end", String(range[1]));
    }
    for (const [name, value] of Object.entries(extra)) {
      if (value !== null && value !== undefined && value !== "") query.set(name, String(value));
    }
    return query.toString();
  }

  // ---- CSV ----

  // Numbers as JavaScript prints them (the shortest text that reads back as the same number), so a
  // CSV holds the very values drawn; text is quoted when it has to be.
  function csvCell(value) {
    if (value === null || value === undefined) return "";
    const text = String(value);
    return /[",\n\r]/.test(text) ? `"${text.replaceAll('"', '""')}"` : text;
  }

  function csvText(table) {
    return [table.columns, ...table.rows].map((row) => row.map(csvCell).join(",")).join("\r\n") + "\r\n";
  }

  function download(filename, text) {
    const url = URL.createObjectURL(new Blob([text], { type: "text/csv" }));
    const anchor = document.createElement("a");
    anchor.href = url;
    anchor.download = filename;
    document.body.appendChild(anchor);
    anchor.click();
    anchor.remove();
    setTimeout(() => URL.revokeObjectURL(url), 0);
  }

  // A "CSV" button in the chart card's heading; `table()` gives {columns, rows} of what is drawn now.
  function addCsvButton(card, filename, table) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "csv-button";
    button.textContent = "CSV";
    button.title = "Download the numbers this chart draws";
    button.addEventListener("click", () =>
      download(typeof filename === "function" ? filename() : filename, csvText(table())),
    );
    (card.querySelector(".chart-tools") || card.querySelector("h2") || card).appendChild(button);
    return button;
  }

  // One row per point of every line trace: the trace's name, x and y, in the order drawn.
  function lineTable(traces, valueName) {
    const rows = [];
    for (const trace of traces) {
      for (let index = 0; index < trace.x.length; index += 1) rows.push([trace.name, trace.x[index], trace.y[index]]);
    }
    return { columns: ["trace", "step", valueName], rows };
  }

  // ---- numbers ----

  // 26 s, 4.1 s, 0.30 s, 12 ms.
  function formatSeconds(seconds) {
    if (seconds >= 10) return `${seconds.toFixed(0)} s`;
    if (seconds >= 1) return `${seconds.toFixed(1)} s`;
    if (seconds >= 0.01) return `${seconds.toFixed(2)} s`;
    return `${(seconds * 1000).toFixed(1)} ms`;
  }

  // A payload value as a chart point: non-finite numbers travel as "NaN"/"Infinity" strings and are
  // kept as such (a diverged loss shows as a gap); a missing one is null.
  function pointValue(value) {
    return value === undefined || value === null ? null : Number(value);
  }

  async function getJson(url) {
    const response = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    return response.json();
  }

  return {
    PLOT_CONFIG,
    MARGIN,
    COLOURS,
    plotWidth,
    onStepRange,
    rangeQuery,
    csvText,
    download,
    addCsvButton,
    lineTable,
    // loom.js's: every page writes bytes in binary units.
    formatBytes: window.loom.formatBytes,
    byteTicks: window.loom.byteTicks,
    logByteTicks: window.loom.logByteTicks,
    formatSeconds,
    pointValue,
    getJson,
  };
})();
