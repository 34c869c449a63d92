"use strict";
// The run page, kept live. Events come from two places: the REST events API (the source of truth)
// and the run's websocket (fast, but it may drop messages). Every event carries the run's next seq,
// so a socket event is applied only when it is exactly the next one; a gap, a reconnect or a quiet
// spell sends the page back to the API for everything after the last seq it applied. That way a
// chart never misses a point and never draws one twice.

(() => {
  const page = JSON.parse(document.getElementById("run-page").textContent);

  const EVENTS_PAGE_SIZE = 1000;
  const LOG_LINES_KEPT = 2000;
  const CAPTURED_LOG_LINES = 200;
  const RECONNECT_FIRST_MS = 500;
  const RECONNECT_LONGEST_MS = 10000;
  const RESYNC_RETRY_MS = 2000;
  // A dropped message is noticed by the gap before the next one, but a dropped last message has
  // no next one: while the run is not finished, a socket this quiet means asking the API.
  const QUIET_SOCKET_MS = 5000;
  const LAUNCHER_RANK = -1;
  const CHART_FOR_METRIC = { loss: "loss-chart", tokens_per_s: "tokens-chart" };
  const AXIS_TITLE = { loss: "loss", tokens_per_s: "tokens/s" };

  const run = {
    lastSeq: 0,
    state: page.state,
    points: Object.fromEntries(Object.keys(CHART_FOR_METRIC).map((metric) => [metric, {}])),
    appliedSeqs: 0,
  };
  window.loomRun = run;

  const stateBadge = document.getElementById("run-state");
  const cancelButton = document.getElementById("cancel-run");
  const notice = document.getElementById("page-notice");
  const attemptRows = document.getElementById("attempt-rows");
  const rankSelect = document.getElementById("log-rank");
  const liveLog = document.getElementById("live-log");
  const loadCapturedButton = document.getElementById("load-captured");
  const capturedLogs = document.getElementById("captured-logs");
  const estimateElement = document.getElementById("run-estimate");
  // What the planner predicted when the run was created on a cluster; null without one.
  const prediction = estimateElement ? JSON.parse(estimateElement.textContent) : null;
  const MIB = 2 ** 20;
  const GIB = 2 ** 30;

  let latestAttempt = page.attempt;
  const logLines = {};

  // ---- drawing: points and log lines queue up and are drawn once per animation frame ----

  const charts = {};
  let pendingPoints = emptyPending();
  let logDirty = false;
  let frameRequested = false;

  function emptyPending() {
    return Object.fromEntries(Object.keys(CHART_FOR_METRIC).map((metric) => [metric, {}]));
  }

  function setUpCharts() {
    for (const [metric, elementId] of Object.entries(CHART_FOR_METRIC)) {
      const element = document.getElementById(elementId);
      const layout = {
        margin: { l: 60, r: 16, t: 8, b: 44 },
        xaxis: { title: { text: "step" } },
        yaxis: { title: { text: AXIS_TITLE[metric] } },
        legend: { orientation: "h", y: -0.25 },
        uirevision: "keep-zoom",
      };
      Plotly.newPlot(element, [], layout, { responsive: true, displaylogo: false });
      charts[metric] = { element, traceForRank: new Map() };
    }
  }

  function requestFrame() {
    if (!frameRequested) {
      frameRequested = true;
      requestAnimationFrame(drawFrame);
    }
  }

  function drawFrame() {
    frameRequested = false;
    for (const [metric, pointsByRank] of Object.entries(pendingPoints)) {
      drawPoints(charts[metric], pointsByRank);
    }
    pendingPoints = emptyPending();
    if (measuredDirty) drawMeasured();
    if (logDirty) {
      logDirty = false;
      const following = liveLog.scrollTop + liveLog.clientHeight >= liveLog.scrollHeight - 4;
      liveLog.textContent = (logLines[rankSelect.value] || []).join("\n");
      if (following) liveLog.scrollTop = liveLog.scrollHeight;
    }
  }

  function drawPoints(chart, pointsByRank) {
    const newTraces = [];
    const extension = { x: [], y: [] };
    const extendedTraces = [];
    for (const [rank, points] of Object.entries(pointsByRank)) {
      const x = points.map((point) => point[0]);
      const y = points.map((point) => point[1]);
      if (chart.traceForRank.has(rank)) {
        extendedTraces.push(chart.traceForRank.get(rank));
        extension.x.push(x);
        extension.y.push(y);
      } else {
        chart.traceForRank.set(rank, chart.traceForRank.size);
        newTraces.push({ x, y, name: `rank ${rank}`, type: "scatter", mode: "lines" });
      }
    }
    if (newTraces.length) Plotly.addTraces(chart.element, newTraces);
    if (extendedTraces.length) Plotly.extendTraces(chart.element, extension, extendedTraces);
  }

  // ---- applying events ----

  function apply(event) {
    if (event.kind === "metric") addMetric(event);
    else if (event.kind === "state") applyState(event);
    else if (event.kind === "log") addLogLine(event.rank, formatLog(event));
    run.lastSeq = event.seq;
    run.appliedSeqs += 1;
  }

  function addMetric(event) {
    for (const metric of Object.keys(CHART_FOR_METRIC)) {
      const value = event.payload[metric];
      if (value === undefined || value === null) continue;
      // A diverged loss arrives as the string "NaN" or "Infinity": Number() keeps it as such.
      const point = [event.step, Number(value)];
      (run.points[metric][event.rank] ||= []).push(point);
      (pendingPoints[metric][event.rank] ||= []).push(point);
    }
    if (prediction) measure(event.rank, event.payload);
    requestFrame();
  }

  // ---- predicted vs measured ----

  // Peak memory is the highest any rank reported (the allocator's peak on GPUs, the peak resident
  // set on CPUs); tokens/s is each rank's latest, averaged, times the data-parallel ranks, because
  // ranks that share a batch (tp, cp, pp) each report that batch's throughput.
  run.measured = { peakMemoryBytes: null, tokensPerSByRank: {}, tokensPerS: null };
  let measuredDirty = false;

  function measure(rank, payload) {
    const peak = payload.memory_peak ?? payload.memory_peak_rss;
    if (typeof peak === "number") run.measured.peakMemoryBytes = Math.max(run.measured.peakMemoryBytes ?? 0, peak);
    const tokensPerS = Number(payload.tokens_per_s);
    if (payload.tokens_per_s != null && Number.isFinite(tokensPerS)) run.measured.tokensPerSByRank[rank] = tokensPerS;
    measuredDirty = true;
  }

  function showPrediction() {
    document.getElementById("predicted-memory").textContent = formatBytes(prediction.memory.peak_bytes);
    document.getElementById("predicted-tokens").textContent = wholeNumber(prediction.tokens_per_s);
  }

  function drawMeasured() {
    measuredDirty = false;
    const { peakMemoryBytes, tokensPerSByRank } = run.measured;
    if (peakMemoryBytes !== null) document.getElementById("measured-memory").textContent = formatBytes(peakMemoryBytes);
    const perRank = Object.values(tokensPerSByRank);
    if (!perRank.length) return;
    const meanPerRank = perRank.reduce((sum, value) => sum + value, 0) / perRank.length;
    run.measured.tokensPerS = meanPerRank * prediction.data_parallel;
    document.getElementById("measured-tokens").textContent = wholeNumber(run.measured.tokensPerS);
  }

  function formatBytes(bytes) {
    return bytes >= GIB ? `${(bytes / GIB).toFixed(2)} GiB` : `${(bytes / MIB).toFixed(1)} MiB`;
  }

  function wholeNumber(value) {
    return Math.round(value).toLocaleString("en-US");
  }

  function applyState(event) {
    const payload = event.payload;
    if (event.rank !== null && event.rank !== LAUNCHER_RANK) {
      addLogLine(event.rank, `${clock(event.time)} rank ${event.rank} ${payload.state}`);
      return;
    }
    updateAttemptRow(payload);
    if (payload.attempt >= latestAttempt) {
      latestAttempt = payload.attempt;
      showRunState(payload.state);
    }
  }

  function showRunState(state) {
    run.state = state;
    stateBadge.textContent = state;
    stateBadge.className = `badge state-${state}`;
    cancelButton.hidden = !page.cancellableStates.includes(state);
  }

  function updateAttemptRow(payload) {
    let row = attemptRows.querySelector(`tr[data-attempt="${payload.attempt}"]`);
    if (!row) {
      row = document.createElement("tr");
      row.dataset.attempt = payload.attempt;
      for (const className of ["attempt-number", "attempt-state", "attempt-exit-code", "attempt-reason"]) {
        row.appendChild(document.createElement("td")).className = className;
      }
      row.querySelector(".attempt-number").textContent = payload.attempt;
      row.querySelector(".attempt-reason").appendChild(document.createElement("pre"));
      attemptRows.appendChild(row);
    }
    const badge = document.createElement("span");
    badge.className = `badge state-${payload.state}`;
    badge.textContent = payload.state;
    row.querySelector(".attempt-state").replaceChildren(badge);
    if ("exit_code" in payload) row.querySelector(".attempt-exit-code").textContent = payload.exit_code ?? "";
    if (payload.reason) row.querySelector(".attempt-reason pre").textContent = payload.reason;
  }

  function formatLog(event) {
    const { level = "INFO", logger = "", message = "" } = event.payload;
    const step = event.step === null ? "" : ` step ${event.step}`;
    return `${clock(event.time)} ${level}${step} ${logger}: ${message}`;
  }

  function addLogLine(rank, line) {
    const lines = (logLines[rank] ||= []);
    lines.push(line);
    if (lines.length > LOG_LINES_KEPT) lines.splice(0, lines.length - LOG_LINES_KEPT);
    if (String(rank) === rankSelect.value) {
      logDirty = true;
      requestFrame();
    }
  }

  function clock(unixSeconds) {
    return new Date(unixSeconds * 1000).toISOString().slice(11, 23);
  }

  // ---- the two sources, kept in seq order ----

  function applyFromApi(events) {
    for (const event of events) {
      if (event.seq > run.lastSeq) apply(event);
    }
  }

  function applyFromSocket(events) {
    for (const event of events) {
      if (event.seq <= run.lastSeq) continue;
      if (event.seq > run.lastSeq + 1) {
        resync();
        return;
      }
      apply(event);
    }
  }

  let resyncing = null;
  let resyncAgain = false;

  // Fetch every event after lastSeq, page by page. Calls while one is running fold into one more round.
  function resync() {
    if (resyncing) {
      resyncAgain = true;
      return resyncing;
    }
    resyncing = (async () => {
      try {
        do {
          resyncAgain = false;
          let eventPage;
          do {
            eventPage = await getJson(`${page.apiUrl}/events?after=${run.lastSeq}&limit=${EVENTS_PAGE_SIZE}`);
            applyFromApi(eventPage.events);
          } while (eventPage.more);
        } while (resyncAgain);
      } catch (error) {
        showNotice(`Could not load events (${error.message}); retrying.`);
        setTimeout(resync, RESYNC_RETRY_MS);
      } finally {
        resyncing = null;
      }
    })();
    return resyncing;
  }

  let reconnectDelay = RECONNECT_FIRST_MS;
  let lastHeardAt = Date.now();

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const socket = new WebSocket(`${scheme}://${location.host}${page.socketPath}`);
    socket.onopen = () => {
      reconnectDelay = RECONNECT_FIRST_MS;
      lastHeardAt = Date.now();
      hideNotice();
      // Whatever was stored between the last fetch and this subscription came over no socket.
      resync();
    };
    socket.onmessage = (message) => {
      lastHeardAt = Date.now();
      const data = JSON.parse(message.data);
      if (data.type === "events") applyFromSocket(data.events);
    };
    socket.onclose = () => {
      showNotice("Live updates disconnected; reconnecting…");
      setTimeout(connect, reconnectDelay);
      reconnectDelay = Math.min(reconnectDelay * 2, RECONNECT_LONGEST_MS);
    };
  }

  function resyncWhenQuiet() {
    if (!page.terminalStates.includes(run.state) && Date.now() - lastHeardAt > QUIET_SOCKET_MS) {
      lastHeardAt = Date.now();
      resync();
    }
  }

  // ---- actions ----

  async function cancelRun() {
    cancelButton.disabled = true;
    try {
      const response = await loom.post(`${page.apiUrl}/cancel`);
      if (response.status === 409) showNotice((await response.json()).detail);
      else if (!response.ok) showNotice(`Cancel failed: HTTP ${response.status}`);
    } catch (error) {
      showNotice(`Cancel failed: ${error.message}`);
    } finally {
      cancelButton.disabled = false;
    }
  }

  async function loadCapturedLogs() {
    const rank = rankSelect.value;
    loadCapturedButton.disabled = true;
    try {
      const tail = await getJson(
        `${page.apiUrl}/attempts/${latestAttempt}/logs/${rank}?lines=${CAPTURED_LOG_LINES}`,
      );
      const blocks = Object.entries(tail.files).map(([name, lines]) => {
        const block = document.createElement("div");
        const heading = block.appendChild(document.createElement("h3"));
        heading.textContent = `rank ${rank}, attempt ${tail.attempt}: ${name}`;
        const text = block.appendChild(document.createElement("pre"));
        text.className = "log";
        text.textContent = lines.join("\n") || "(empty)";
        return block;
      });
      if (!blocks.length) {
        const empty = document.createElement("p");
        empty.textContent = `Nothing captured yet for rank ${rank} in attempt ${tail.attempt}.`;
        blocks.push(empty);
      }
      capturedLogs.replaceChildren(...blocks);
      capturedLogs.hidden = false;
      // A tail is read from its end: show the newest lines first.
      for (const text of capturedLogs.querySelectorAll("pre")) text.scrollTop = text.scrollHeight;
    } catch (error) {
      showNotice(`Could not load captured logs (${error.message}).`);
    } finally {
      loadCapturedButton.disabled = false;
    }
  }

  function showRank() {
    capturedLogs.hidden = true;
    liveLog.textContent = "";
    logDirty = true;
    requestFrame();
  }

  // ---- small helpers ----

  async function getJson(url) {
    const response = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    return response.json();
  }

  function showNotice(text) {
    notice.textContent = text;
    notice.hidden = false;
  }

  function hideNotice() {
    notice.hidden = true;
  }

  async function start() {
    setUpCharts();
    if (prediction) showPrediction();
    cancelButton.addEventListener("click", cancelRun);
    loadCapturedButton.addEventListener("click", loadCapturedLogs);
    rankSelect.addEventListener("change", showRank);
    await resync();
    connect();
    setInterval(resyncWhenQuiet, QUIET_SOCKET_MS);
  }

  start();
})();
