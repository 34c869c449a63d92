"use strict";
// The triage page's actions: acknowledge or resolve an alert, restore from the checkpoint before it, cancel
// the run. Each goes through the API and the page reloads to show where things stand.

(() => {
  const page = JSON.parse(document.getElementById("triage-page").textContent);
  const notice = document.getElementById("triage-notice");

  function show(message) {
    notice.textContent = message;
    notice.hidden = false;
  }

  async function act(url, body, then) {
    const response = await window.loom.post(url, body);
    const answer = await response.json().catch(() => ({}));
    if (!response.ok) {
      const errors = answer.errors ? Object.values(answer.errors).join("; ") : response.statusText;
      show(`Could not do that: ${errors}`);
      return;
    }
    then(answer);
  }

  const forAlert = (template, id) => template.replace("/0/", `/${id}/`);

  for (const card of document.querySelectorAll(".alert-card")) {
    const id = card.dataset.alert;
    card.querySelector(".acknowledge")?.addEventListener("click", () =>
      act(forAlert(page.urls.acknowledge, id), undefined, () => location.reload()),
    );
    card.querySelector(".resolve")?.addEventListener("click", () =>
      act(forAlert(page.urls.resolve, id), undefined, () => location.reload()),
    );
    card.querySelector(".restore")?.addEventListener("click", (click) => {
      const body = { checkpoint: Number(click.currentTarget.dataset.checkpoint), mode: "attempt" };
      // Past a spike: skip the data that caused it and lower the learning rate, when kept ticked and filled.
      const skip = card.querySelector(".skip-data");
      if (skip?.checked) body.skip_steps = [Number(skip.dataset.first), Number(skip.dataset.last)];
      const lr = card.querySelector(".restore-lr");
      if (lr && lr.value !== "") body.lr = Number(lr.value);
      act(page.urls.restore, body, () => {
        location.href = page.urls.run;
      });
    });
  }
  document.getElementById("cancel-run")?.addEventListener("click", () =>
    act(page.urls.cancel, undefined, () => location.reload()),
  );
})();

// Around each alert: the run's loss and gradient norm over the steps before and after it, and the rank ×
// step heatmap of that moment (own work for a straggler, memory for creep, else step time) with the
// alert's ranks outlined. Drawn as each card comes into view.
window.loomTriage = (() => {
  const page = JSON.parse(document.getElementById("triage-page").textContent);
  const state = { drawn: {} };
  const BEFORE_STEPS = 30;
  const AFTER_STEPS = 10;
  const WIDTH = 400;
  const LAYOUT = { margin: { l: 50, r: 50, t: 28, b: 36 }, showlegend: true, legend: { orientation: "h" } };
  const CONFIG = { displaylogo: false, responsive: true };

  async function getJson(url) {
    const response = await fetch(url, { credentials: "same-origin" });
    if (!response.ok) throw new Error(`${url}: ${response.status}`);
    return response.json();
  }

  function marker(step) {
    return { type: "line", xref: "x", yref: "paper", x0: step, x1: step, y0: 0, y1: 1, line: { dash: "dot" } };
  }

  // At most about 16 rank ticks, each on a whole rank.
  function rankTickStep(ranks) {
    return Math.max(1, Math.ceil(ranks / 16));
  }

  // How the heatmap's hover and colour bar write its values: memory in binary units (Plotly's SI
  // suffixes would write 50 GB as "50G"), times in seconds.
  function heatmapValues(heat) {
    const where = "rank %{y}, step %{x}";
    if (heat.metric !== "memory_bytes") return { hovertemplate: `${where}: %{z:.3f} s<extra></extra>` };
    const cells = heat.z.flat().filter((value) => value !== null && Number.isFinite(value));
    const low = cells.reduce((least, value) => Math.min(least, value), Infinity);
    const high = cells.reduce((most, value) => Math.max(most, value), -Infinity);
    const ticks = cells.length ? window.loom.byteTicks(low, high) : {};
    return {
      text: heat.z.map((row) => row.map(window.loom.formatBytes)),
      hovertemplate: `${where}: %{text}<extra></extra>`,
      colorbar: { title: { text: "bytes" }, tickmode: "array", ...ticks },
    };
  }

  async function draw(box) {
    const alertId = box.closest(".alert-card").dataset.alert;
    const attempt = Number(box.dataset.attempt);
    const step = Number(box.dataset.step);
    const start = Math.max(1, step - BEFORE_STEPS);
    const end = Number(box.dataset.lastStep) + AFTER_STEPS;
    const range = `width=${WIDTH}&start=${start}&end=${end}`;
    const [series, heat] = await Promise.all([
      getJson(`${page.urls.series}?${range}`),
      getJson(`${page.urls.heatmap}?${range}&attempt=${attempt}&metric=${box.dataset.metric}`),
    ]);
    const curves = (series.attempts.find((item) => item.attempt === attempt) || { series: {} }).series;
    const traces = ["loss_mean", "grad_norm"]
      .filter((name) => curves[name])
      .map((name, index) => ({
        name,
        x: curves[name].step,
        y: curves[name].value,
        yaxis: index ? "y2" : "y",
        mode: "lines",
      }));
    Plotly.newPlot(
      box.querySelector(".alert-curves"),
      traces,
      { ...LAYOUT, title: { text: "around the alert", font: { size: 13 } }, shapes: [marker(step)],
        yaxis2: { overlaying: "y", side: "right" } },
      CONFIG,
    );
    const ranks = box.dataset.ranks ? box.dataset.ranks.split(",").map(Number) : [];
    const outline = ranks.map((rank) => ({
      type: "rect", xref: "paper", yref: "y", x0: 0, x1: 1, y0: rank - 0.5, y1: rank + 0.5,
      line: { color: "#d7263d", width: 2 },
    }));
    Plotly.newPlot(
      box.querySelector(".alert-heatmap"),
      [{ type: "heatmap", x: heat.steps, y: heat.ranks, z: heat.z, colorscale: "Viridis", ...heatmapValues(heat) }],
      { ...LAYOUT, showlegend: false, title: { text: `${heat.metric} per rank`, font: { size: 13 } },
        shapes: [...outline, marker(step)],
        // Whole ranks only, and no zero line through rank 0's cells.
        xaxis: { zeroline: false },
        yaxis: { title: "rank", autorange: "reversed", tick0: 0, dtick: rankTickStep(heat.ranks.length),
                 zeroline: false } },
      CONFIG,
    );
    state.drawn[alertId] = { curves: traces.length, heatmap: heat, ranks };
  }

  const watcher = new IntersectionObserver((entries) => {
    for (const entry of entries) {
      if (!entry.isIntersecting) continue;
      watcher.unobserve(entry.target);
      draw(entry.target).catch((error) => {
        entry.target.textContent = `could not draw the charts: ${error.message}`;
      });
    }
  });
  for (const box of document.querySelectorAll(".alert-charts")) watcher.observe(box);
  return state;
})();
