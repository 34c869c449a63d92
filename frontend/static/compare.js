"use strict";
// The comparison page: the run-level curves of several runs on the same axes, a colour per run and a
// line per attempt (a restart starts its own line where it resumed). Each run's curves come from its
// metrics API sized to the chart's width; a zoom asks every run again for that step range.

(() => {
  const C = window.loomCharts;
  const page = JSON.parse(document.getElementById("compare-page").textContent);
  const SERIES = {
    loss: { metric: "loss_mean", axis: "loss (mean over ranks)", hover: "%{y:.4f}" },
    // Only on the steps each run evaluated: a point each, joined.
    eval_loss: { metric: "eval_loss", axis: "validation loss", hover: "%{y:.4f}", markers: true },
    grad_norm: { metric: "grad_norm", axis: "gradient norm", hover: "%{y:.4f}" },
    lr: { metric: "lr", axis: "learning rate", hover: "%{y:.3e}" },
    tokens_per_s: { metric: "tokens_per_s", axis: "tokens/s, all ranks", hover: "%{y:,.0f}" },
    mfu: { metric: "mfu", axis: "MFU", hover: "%{y:.1%}", yaxis: { tickformat: ".0%" } },
  };
  const DASHES = ["solid", "dash", "dot", "dashdot"];
  const EMPTY_NOTES = {
    mfu: "no MFU reported: it is not measured on CPU",
    eval_loss: "no validation loss: none of these runs evaluates (eval.interval_steps)",
  };

  // chart → run id → attempt → {step, value}: what each chart draws.
  const compare = { runs: page.runs, series: {} };
  window.loomCompare = compare;
  const tickets = {};
  const notice = document.getElementById("page-notice");

  function colourOf(index) {
    return C.COLOURS[index % C.COLOURS.length];
  }

  const elements = {};

  // One request per run answers every chart; a zoom asks again for its chart's step range only.
  async function load(keys, range) {
    const owned = keys.map((key) => (tickets[key] = (tickets[key] || 0) + 1));
    const width = C.plotWidth(elements[keys[0]]);
    let answers;
    try {
      answers = await Promise.all(page.runs.map((run) => C.getJson(`${run.seriesUrl}?${C.rangeQuery(width, range)}`)));
    } catch (error) {
      notice.textContent = `Could not load the runs' curves (${error.message}).`;
      notice.hidden = false;
      return;
    }
    keys.forEach((key, index) => {
      if (owned[index] !== tickets[key]) return;
      compare.series[key] = Object.fromEntries(
        page.runs.map((run, order) => [
          run.id,
          Object.fromEntries(
            answers[order].attempts.map((attempt) => [attempt.attempt, attempt.series[SERIES[key].metric]]),
          ),
        ]),
      );
      draw(key, elements[key]);
    });
  }

  function traces(key) {
    const drawn = [];
    page.runs.forEach((run, index) => {
      const attempts = compare.series[key]?.[run.id] || {};
      const numbers = Object.keys(attempts)
        .map(Number)
        .sort((a, b) => a - b);
      numbers.forEach((attempt, order) => {
        const curve = attempts[attempt];
        // MFU on CPU ranks is reported as missing at every step, validation loss by a run that never
        // evaluates: such an attempt has no line.
        if (!curve || !curve.value.some((value) => value !== null)) return;
        const name = numbers.length > 1 ? `${run.name} · attempt ${attempt}` : run.name;
        drawn.push({
          x: curve.step,
          y: curve.value,
          name,
          legendgroup: String(run.id),
          type: "scatter",
          mode: curve.step.length > 1 ? (SERIES[key].markers ? "lines+markers" : "lines") : "markers",
          line: { color: colourOf(index), width: 1.5, dash: DASHES[order % DASHES.length] },
          marker: { color: colourOf(index) },
          hovertemplate: `step %{x}: ${SERIES[key].hover}<extra>${name.replaceAll("<", "&lt;")}</extra>`,
        });
      });
    });
    return drawn;
  }

  function draw(key, element) {
    const drawn = traces(key);
    // Without points, a note and no axes: Plotly's range for no data (-1 to 4) means nothing.
    const shown = { visible: drawn.length > 0 };
    const layout = {
      margin: C.MARGIN,
      xaxis: { title: { text: "step" }, ...shown },
      yaxis: { title: { text: SERIES[key].axis }, ...SERIES[key].yaxis, ...shown },
      legend: { orientation: "h", y: -0.25 },
      showlegend: true,
      uirevision: "keep-zoom",
      annotations: drawn.length
        ? []
        : [
            {
              text: EMPTY_NOTES[key] || "no points",
              showarrow: false,
              xref: "paper",
              yref: "paper",
              x: 0.5,
              y: 0.5,
              font: { color: "#5f6b7a" },
            },
          ],
    };
    Plotly.react(element, drawn, layout, C.PLOT_CONFIG);
  }

  function start() {
    document.querySelectorAll("#compared-runs li").forEach((item, index) => {
      item.querySelector(".swatch").style.background = colourOf(index);
    });
    for (const element of document.querySelectorAll(".chart[data-series]")) {
      const key = element.dataset.series;
      elements[key] = element;
      Plotly.newPlot(element, [], { margin: C.MARGIN }, C.PLOT_CONFIG);
      C.addCsvButton(
        element.closest(".chart-card"),
        `compare-runs-${page.runs.map((run) => run.id).join("-")}-${key}.csv`,
        () => C.lineTable(traces(key), SERIES[key].metric),
      );
      C.onStepRange(element, (range) => load([key], range));
    }
    load(Object.keys(elements), null);
  }

  if (page.runs.length) start();
})();
