"use strict";
// The run page, kept live. Events come from two places: the REST events API (the source of truth)
// and the run's websocket (fast, but it may drop messages). Every event carries the run's next seq,
// so a socket event is applied only when it is exactly the next one; a gap, a reconnect or a quiet
// spell sends the page back to the API for everything after the last seq it applied. That way a
// chart never misses a point and never draws one twice.
//
// The page does not replay a run's history from seq 0 (a 1,024-rank run has millions of events): the
// charts load the metrics API (run_charts.js), whose answers say up to which seq they hold, and the
// logs, states and checkpoints before that seq come from the events API filtered to those kinds.
// Events after it are applied one by one.
//
// Attempts, checkpoints and the resilience figures are not patched from events: a state or a
// checkpoint event asks the API for all three again (at most once per DETAILS_DELAY_MS), so what the
// page shows of them is what the server holds, restarts and restores included.

(() => {
  const page = JSON.parse(document.getElementById("run-page").textContent);

  const EVENTS_PAGE_SIZE = 1000;
  const HISTORY_KINDS = "log,state,checkpoint";
  const LOG_LINES_KEPT = 2000;
  const CAPTURED_LOG_LINES = 200;
  const RECONNECT_FIRST_MS = 500;
  const RECONNECT_LONGEST_MS = 10000;
  const RESYNC_RETRY_MS = 2000;
  // A dropped message is noticed by the gap before the next one, but a dropped last message has
  // no next one: while the run is not finished, a socket this quiet means asking the API.
  const QUIET_SOCKET_MS = 5000;
  const LAUNCHER_RANK = -1;
  const DETAILS_DELAY_MS = 300;
  const DEGREES = ["dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"];

  const run = {
    lastSeq: 0,
    // The seq the charts' snapshot holds everything up to; events after it were applied one by one.
    snapshotSeq: null,
    state: page.state,
    // While a websocket message is being applied: when it was sent and received (applyFromSocket).
    delivery: null,
    // Events applied one by one: the history before the snapshot (logs, states, checkpoints) and
    // every event after it.
    appliedSeqs: 0,
    // What arrived over the websocket and what the events API filled in.
    socket: { opened: 0, messages: 0, events: 0, gaps: 0 },
    fetched: { requests: 0, events: 0 },
    // The latest answers of the run, checkpoints and resilience APIs.
    detail: null,
    checkpoints: [],
    resilience: null,
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
  const checkpointRows = document.getElementById("checkpoint-rows");
  const restoreForm = document.getElementById("restore-form");
  const restoreLaunch = document.getElementById("restore-launch");
  const estimateElement = document.getElementById("run-estimate");
  // What the planner predicted when the run was created on a cluster; null without one.
  const prediction = estimateElement ? JSON.parse(estimateElement.textContent) : null;
  const { formatBytes, formatSeconds, getJson } = window.loomCharts;

  let latestAttempt = page.attempt;
  const logLines = {};

  // ---- drawing: charts and log lines are redrawn at most once per animation frame ----

  let logDirty = false;
  let frameRequested = false;

  function requestFrame() {
    if (!frameRequested) {
      frameRequested = true;
      requestAnimationFrame(drawFrame);
    }
  }

  const charts = window.loomRunCharts(page, run, requestFrame);
  // The Experts panel, on the page of a mixture-of-experts run only.
  const experts = page.experts > 1 ? window.loomRunExperts(page, run, requestFrame) : null;

  function drawFrame() {
    frameRequested = false;
    charts.draw();
    experts?.draw();
    if (measuredDirty) drawMeasured();
    if (logDirty) {
      logDirty = false;
      const following = liveLog.scrollTop + liveLog.clientHeight >= liveLog.scrollHeight - 4;
      liveLog.textContent = (logLines[rankSelect.value] || []).join("\n");
      if (following) liveLog.scrollTop = liveLog.scrollHeight;
    }
  }

  // ---- applying events ----

  function apply(event) {
    if (event.kind === "metric") addMetric(event);
    else if (event.kind === "comm") charts.applyComm(event);
    else if (event.kind === "state") applyState(event);
    else if (event.kind === "log") addLogLine(event.rank, formatLog(event));
    if (event.kind === "state" || event.kind === "checkpoint") scheduleDetails();
    run.lastSeq = event.seq;
    run.appliedSeqs += 1;
  }

  function addMetric(event) {
    charts.applyMetric(event);
    experts?.applyMetric(event);
    if (prediction) {
      measure(event.rank, event.payload);
      requestFrame();
    }
  }

  // ---- predicted vs measured ----

  // Peak memory is the highest any rank reported (the allocator's peak on GPUs, the peak resident
  // set on CPUs); tokens/s is each rank's latest, averaged, times the data-parallel ranks, because
  // ranks that share a batch (tp, cp, pp) each report that batch's throughput. Until events arrive,
  // the snapshot's figures stand in: the latest tokens/s point and the highest memory any rank drew.
  run.measured = { peakMemoryBytes: null, tokensPerSByRank: {}, tokensPerS: null };
  let measuredDirty = false;

  function measure(rank, payload) {
    const peak = payload.memory_peak ?? payload.memory_peak_rss;
    if (typeof peak === "number") run.measured.peakMemoryBytes = Math.max(run.measured.peakMemoryBytes ?? 0, peak);
    const tokensPerS = Number(payload.tokens_per_s);
    if (payload.tokens_per_s != null && Number.isFinite(tokensPerS)) run.measured.tokensPerSByRank[rank] = tokensPerS;
    measuredDirty = true;
  }

  function measureSnapshot() {
    const figures = charts.snapshotFigures();
    run.measured.peakMemoryBytes = figures.memoryBytes;
    run.measured.tokensPerS = figures.tokensPerS;
    measuredDirty = true;
    requestFrame();
  }

  // The prediction is for the cluster's GPUs: beside a measurement on a CPU, or on GPUs of another
  // kind, its numbers would compare unlike things, so the page says so instead.
  function showPrediction() {
    const { cluster } = prediction;
    const planned = `${cluster.nodes * cluster.gpus_per_node} × ${cluster.gpu}`;
    const note = document.getElementById("prediction-hardware");
    const ran = run.hardware;
    // The planner's GPU types are named by their family first ("H100-SXM", "A100-80GB"); torch names
    // the device with its vendor ("NVIDIA H100 80GB HBM3"). A trainer that did not name it ("cuda:0") is
    // given the benefit of the doubt.
    const otherGpu = ran && !ran.onCpu && ran.named && !ran.name.includes(cluster.gpu.split("-")[0]);
    const applies = !ran || !(ran.onCpu || otherGpu);
    document.getElementById("predicted-memory").textContent = applies ? formatBytes(prediction.memory.peak_bytes) : "–";
    document.getElementById("predicted-tokens").textContent = applies ? wholeNumber(prediction.tokens_per_s) : "–";
    const ranOn = ran && (ran.onCpu ? "CPU" : ran.name);
    document.getElementById("measured-heading").textContent = ran ? `Measured on ${ranOn}` : "Measured";
    note.textContent = applies ? "" : `planned for ${planned}; this attempt ran on ${ranOn}: the prediction does not apply`;
    note.hidden = applies;
  }

  // ---- the hardware the latest attempt runs on ----

  // Each rank's "started" state event names its device ("cpu", "cuda:3") and, from newer trainers, the
  // device's name; the latest attempt's decides whether the prediction applies and why MFU is missing.
  run.hardware = null;

  function noteHardware(number, payload) {
    if (!payload.device || (run.hardware && number < run.hardware.attempt)) return;
    const onCpu = payload.device.startsWith("cpu");
    const name = payload.device_name || payload.device;
    if (run.hardware && run.hardware.attempt === number && run.hardware.name === name) return;
    run.hardware = { attempt: number, onCpu, name, named: Boolean(payload.device_name) };
    charts.showHardware(run.hardware);
    if (prediction) showPrediction();
  }

  function drawMeasured() {
    measuredDirty = false;
    const { peakMemoryBytes, tokensPerSByRank } = run.measured;
    if (peakMemoryBytes !== null) document.getElementById("measured-memory").textContent = formatBytes(peakMemoryBytes);
    const perRank = Object.values(tokensPerSByRank);
    if (perRank.length) {
      const meanPerRank = perRank.reduce((sum, value) => sum + value, 0) / perRank.length;
      run.measured.tokensPerS = meanPerRank * prediction.data_parallel;
    }
    if (run.measured.tokensPerS !== null) {
      document.getElementById("measured-tokens").textContent = wholeNumber(run.measured.tokensPerS);
    }
  }

  function wholeNumber(value) {
    return Math.round(value).toLocaleString("en-US");
  }

  function applyState(event) {
    const payload = event.payload;
    if (event.rank !== null && event.rank !== LAUNCHER_RANK) {
      addLogLine(event.rank, `${clock(event.time)} rank ${event.rank} ${payload.state}`);
      if (payload.state === "started") noteHardware(event.attempt, payload);
      return;
    }
    // The run's state is its latest attempt's; a late event of an earlier attempt does not change it.
    const number = event.attempt ?? payload.attempt;
    if (number >= latestAttempt) {
      latestAttempt = number;
      showRunState(payload.state);
    }
  }

  function showRunState(state) {
    run.state = state;
    stateBadge.textContent = state;
    stateBadge.className = `badge state-${state}`;
    cancelButton.hidden = !page.cancellableStates.includes(state);
    showRestoreAvailability();
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
    run.fetched.requests += 1;
    for (const event of events) {
      if (event.seq > run.lastSeq) {
        apply(event);
        run.fetched.events += 1;
      }
    }
  }

  // delivery: when the message left the platform (`sent`, its clock) and reached this page (`received`).
  function applyFromSocket(events, delivery) {
    run.socket.messages += 1;
    run.socket.events += events.length;
    run.delivery = delivery;
    try {
      for (const event of events) {
        if (event.seq <= run.lastSeq) continue;
        if (event.seq > run.lastSeq + 1) {
          run.socket.gaps += 1;
          resync();
          return;
        }
        apply(event);
      }
    } finally {
      run.delivery = null;
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
      run.socket.opened += 1;
      reconnectDelay = RECONNECT_FIRST_MS;
      lastHeardAt = Date.now();
      hideNotice();
      // Whatever was stored between the last fetch and this subscription came over no socket.
      resync();
    };
    socket.onmessage = (message) => {
      lastHeardAt = Date.now();
      const data = JSON.parse(message.data);
      if (data.type === "events") applyFromSocket(data.events, { sent: data.sent, received: lastHeardAt });
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
      if (response.status === 409) showNotice(Object.values((await response.json()).errors).join("; "));
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

  // ---- attempts, checkpoints and resilience, from the API ----

  let detailsTimer = null;
  let refreshing = null;
  let refreshAgain = false;

  // Events come in bursts (a restart is a failed state, a queued state and checkpoint events): one
  // refresh follows each burst, and calls while one is running fold into one more round.
  function scheduleDetails() {
    if (detailsTimer !== null) return;
    detailsTimer = setTimeout(() => {
      detailsTimer = null;
      refreshDetails();
    }, DETAILS_DELAY_MS);
  }

  function refreshDetails() {
    if (refreshing) {
      refreshAgain = true;
      return refreshing;
    }
    refreshing = (async () => {
      try {
        do {
          refreshAgain = false;
          const [detail, checkpoints, resilience] = await Promise.all([
            getJson(page.apiUrl),
            getJson(page.urls.checkpoints),
            getJson(page.urls.resilience),
          ]);
          showDetails(detail, checkpoints, resilience);
        } while (refreshAgain);
      } catch (error) {
        showNotice(`Could not load attempts and checkpoints (${error.message}); retrying.`);
        setTimeout(scheduleDetails, RESYNC_RETRY_MS);
      } finally {
        refreshing = null;
      }
    })();
    return refreshing;
  }

  function showDetails(detail, checkpoints, resilience) {
    run.detail = detail;
    run.checkpoints = checkpoints;
    run.resilience = resilience;
    const latest = detail.attempts[detail.attempts.length - 1];
    // The API can know of an attempt no event has brought yet (one restored from this page): the
    // run's state is that attempt's, so a quiet socket sends the page to the events API while it runs.
    if (latest.number > latestAttempt) {
      latestAttempt = latest.number;
      showRunState(latest.state);
    }
    attemptRows.replaceChildren(...detail.attempts.map(attemptRow));
    followWorldSize(latest.world_size);
    charts.attemptsChanged(detail);
    showCheckpoints(checkpoints);
    showResilience(resilience);
    showRestoreAvailability();
    showTarget();
  }

  function attemptRow(attempt) {
    const row = document.createElement("tr");
    row.dataset.attempt = attempt.number;
    const cell = (className) => {
      const element = row.appendChild(document.createElement("td"));
      element.className = className;
      return element;
    };
    cell("attempt-number").textContent = attempt.number;
    cell("attempt-state").appendChild(badge(attempt.state));
    const nodes = cell("attempt-nodes");
    if (attempt.pending_reason) {
      nodes.appendChild(document.createElement("span")).className = "pending-reason";
      nodes.lastChild.textContent = `waiting for the scheduler: ${attempt.pending_reason}`;
    } else {
      nodes.textContent = attempt.nodes.join(", ");
    }
    const trigger = cell("attempt-trigger");
    trigger.append(attempt.trigger);
    if (attempt.restored_from !== null) {
      trigger.append(" · ", link(checkpointHref(attempt.restored_from), `from step ${attempt.restored_from_step}`));
    }
    if (attempt.trigger_note) trigger.appendChild(paragraph(attempt.trigger_note, "note"));
    cell("attempt-exit-code").textContent = attempt.exit_code ?? "";
    const retryable = { true: "retryable", false: "not retryable" }[attempt.retryable] ?? "retryable unknown";
    cell("attempt-failure").textContent = attempt.failure_kind ? `${attempt.failure_kind} · ${retryable}` : "";
    cell("attempt-decision").textContent = attempt.restart_decision;
    const reason = cell("attempt-reason");
    reason.appendChild(document.createElement("pre")).textContent = attempt.failure_reason;
    if (attempt.batches_set_aside) {
      const refused = `${attempt.batches_set_aside} telemetry batch${attempt.batches_set_aside === 1 ? "" : "es"}`;
      reason.appendChild(paragraph(`${refused} refused by the platform, kept in the spools' rejected/ folders`, "note set-aside"));
    }
    return row;
  }

  // A checkpoint of this run is a row below; the one a fork started from is on its run's page.
  function checkpointHref(checkpointId) {
    const anchor = `#checkpoint-${checkpointId}`;
    return checkpointId === run.detail.forked_from ? `/runs/${run.detail.forked_from_run}/${anchor}` : anchor;
  }

  // The rank selector offers the ranks of the latest attempt (a restore may change the world size).
  function followWorldSize(worldSize) {
    if (rankSelect.options.length === worldSize) return;
    const selected = Number(rankSelect.value) < worldSize ? rankSelect.value : "0";
    rankSelect.replaceChildren(
      ...Array.from({ length: worldSize }, (_, rank) => new Option(String(rank), String(rank))),
    );
    rankSelect.value = selected;
    showRank();
  }

  function showCheckpoints(checkpoints) {
    const stepOf = new Map(checkpoints.map((checkpoint) => [checkpoint.id, checkpoint.step]));
    checkpointRows.replaceChildren(...checkpoints.map((checkpoint) => checkpointRow(checkpoint, stepOf)));
    document.getElementById("checkpoints-table").hidden = checkpoints.length === 0;
    document.getElementById("checkpoints-empty").hidden = checkpoints.length > 0;
    if (restoring) {
      const current = checkpoints.find((checkpoint) => checkpoint.id === restoring.id);
      if (current && current.state !== "committed") closeRestore();
      else if (current) checkpointRows.querySelector(`tr[data-checkpoint="${current.id}"]`).classList.add("restoring");
    }
  }

  function checkpointRow(checkpoint, stepOf) {
    const row = document.createElement("tr");
    row.id = `checkpoint-${checkpoint.id}`;
    Object.assign(row.dataset, {
      checkpoint: checkpoint.id,
      step: checkpoint.step,
      attempt: checkpoint.attempt,
      state: checkpoint.state,
    });
    const cell = (className) => {
      const element = row.appendChild(document.createElement("td"));
      element.className = className;
      return element;
    };
    cell("checkpoint-step").textContent = checkpoint.step;
    cell("checkpoint-attempt").appendChild(link(`#attempt-${checkpoint.attempt}`, `attempt ${checkpoint.attempt}`));
    const state = cell("checkpoint-state");
    state.appendChild(badge(checkpoint.state));
    if (checkpoint.problem) state.appendChild(paragraph(checkpoint.problem, "note"));
    if (checkpoint.pinned) {
      state.append(" ", badge("pinned"));
      state.appendChild(paragraph(`kept past retention: ${checkpoint.pins.join("; ")}`, "note checkpoint-pins"));
    }
    cell("checkpoint-size").textContent = formatBytes(checkpoint.bytes);
    cell("checkpoint-loss").textContent = checkpoint.loss === null ? "" : checkpoint.loss.toFixed(4);
    const stall = cell("checkpoint-stall");
    if (checkpoint.stall_s !== null) stall.textContent = formatSeconds(checkpoint.stall_s);
    if (checkpoint.save_s !== null) stall.title = `committed ${formatSeconds(checkpoint.save_s)} after the save began`;
    const saved = cell("checkpoint-saved").appendChild(document.createElement("time"));
    saved.dateTime = checkpoint.committed_at;
    saved.textContent = new Date(checkpoint.committed_at).toLocaleString("sv-SE");
    const layout = cell("checkpoint-layout");
    layout.textContent = layoutText(checkpoint.layout);
    layout.title = `${count(checkpoint.world_size, "rank")}; ${checkpoint.path}`;
    const parent = cell("checkpoint-parent");
    if (stepOf.has(checkpoint.parent)) {
      parent.appendChild(link(`#checkpoint-${checkpoint.parent}`, `step ${stepOf.get(checkpoint.parent)}`));
    } else if (checkpoint.parent !== null && checkpoint.parent === run.detail.forked_from) {
      const text = `run ${run.detail.forked_from_run} step ${run.detail.forked_from_step}`;
      parent.appendChild(link(checkpointHref(checkpoint.parent), text));
    }
    const action = cell("checkpoint-action");
    if (checkpoint.state === "committed") {
      const button = action.appendChild(document.createElement("button"));
      button.type = "button";
      button.className = "restore-button";
      button.textContent = "Restore…";
      button.addEventListener("click", () => openRestore(checkpoint));
      action.appendChild(pinButton(checkpoint));
      action.appendChild(exportButton(checkpoint));
    }
    return row;
  }

  // Hugging Face's format, written by a worker: the page follows the export until it is ready or failed.
  const EXPORT_POLL_MS = 1000;
  function exportButton(checkpoint) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "export-button";
    button.textContent = "Export";
    button.title = "Write it as a Hugging Face Llama directory (config.json and safetensors)";
    button.addEventListener("click", async () => {
      button.disabled = true;
      try {
        const url = page.urls.exportCheckpoint.replace(/\/0\/export$/, `/${checkpoint.id}/export`);
        const response = await loom.post(url, {});
        let job = await response.json();
        if (!response.ok) throw new Error(Object.values(job.errors ?? {}).join("; ") || `HTTP ${response.status}`);
        showNotice(`Exporting the checkpoint of step ${checkpoint.step} to Hugging Face's format…`);
        while (job.state === "queued" || job.state === "converting") {
          await new Promise((resolve) => setTimeout(resolve, EXPORT_POLL_MS));
          job = await getJson(page.urls.exports.replace(/\/0$/, `/${job.id}`));
        }
        if (job.state !== "ready") throw new Error(job.error || job.state);
        showNotice(`The checkpoint of step ${checkpoint.step} is exported to ${job.out_path}`);
      } catch (error) {
        showNotice(`Could not export the checkpoint of step ${checkpoint.step} (${error.message}).`);
      }
      button.disabled = false;
    });
    return button;
  }

  // A person's pin keeps a checkpoint past keep_last until they unpin it; an alert's lasts while it is live.
  function pinButton(checkpoint) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "pin-button";
    const change = checkpoint.user_pinned ? "unpin" : "pin";
    button.textContent = checkpoint.user_pinned ? "Unpin" : "Pin";
    button.title = checkpoint.user_pinned
      ? "Let retention delete it again once no alert needs it"
      : "Keep it past retention (keep_last) until you unpin it";
    button.addEventListener("click", async () => {
      button.disabled = true;
      try {
        const response = await loom.post(`${page.urls.checkpoints}/${checkpoint.id}/${change}`);
        const answer = await response.json();
        if (!response.ok) throw new Error(Object.values(answer.errors ?? {}).join("; ") || `HTTP ${response.status}`);
        await refreshDetails();
      } catch (error) {
        showNotice(`Could not ${change} the checkpoint of step ${checkpoint.step} (${error.message}).`);
        button.disabled = false;
      }
    });
    return button;
  }

  // "dp_replicate 2 · tp 2": the degrees the layout uses, or one rank.
  function layoutText(layout) {
    const degrees = DEGREES.filter((degree) => layout[degree] > 1).map((degree) => `${degree} ${layout[degree]}`);
    if (layout.pp > 1 && layout.pp_schedule) degrees.push(layout.pp_schedule);
    return degrees.join(" · ") || "1 rank";
  }

  // ---- links from elsewhere (the lineage page) to a checkpoint or an attempt row ----

  let scrolledTo = "";

  function targetOf(hash) {
    const match = /^#(checkpoint|attempt)-(\d+)$/.exec(hash);
    return match ? { kind: match[1], id: match[2] } : null;
  }

  function showTarget() {
    const target = targetOf(location.hash);
    for (const row of document.querySelectorAll("tr.targeted")) row.classList.remove("targeted");
    if (!target) return;
    const row = document.querySelector(`tr[data-${target.kind}="${target.id}"]`);
    if (!row) return;
    row.classList.add("targeted");
    if (scrolledTo !== location.hash) {
      scrolledTo = location.hash;
      row.scrollIntoView({ block: "center" });
    }
  }

  // ---- restoring a checkpoint ----

  // Restore errors beside the inputs they name ("config.parallel.tp"); what names no input (the model's
  // sequence length, say, which a new tp must divide) in this list above the form.
  const restoreErrors = document.getElementById("restore-errors");
  const restoreName = document.getElementById("restore-name");
  const restoreSteps = document.getElementById("restore-steps");
  const restoreBusy = document.getElementById("restore-busy");
  const layoutInputs = [...restoreForm.querySelectorAll("[data-path]")];
  const PARALLEL_PREFIX = "parallel.";
  let restoring = null;
  let launching = false;

  function restoreMode() {
    return restoreForm.querySelector('input[name="restore-mode"]:checked').value;
  }

  function runIsActive() {
    return !page.terminalStates.includes(run.state);
  }

  // The layout as saved, field by field; what the saved layout lacks shows the schema default.
  function openRestore(checkpoint) {
    restoring = checkpoint;
    document.getElementById("restore-title").textContent =
      `Restore step ${checkpoint.step} (attempt ${checkpoint.attempt}, ${layoutText(checkpoint.layout)})`;
    for (const input of layoutInputs) {
      const saved = checkpoint.layout[input.dataset.path.slice(PARALLEL_PREFIX.length)];
      input.value = saved === undefined || saved === null ? input.dataset.default : String(saved);
      input.dataset.saved = input.value;
    }
    restoreSteps.value = "";
    restoreName.value = "";
    restoreName.placeholder = `${run.detail.name} from step ${checkpoint.step}`;
    // A new attempt needs the run to be finished; while it is not, forking is what can be done.
    const mode = runIsActive() ? "fork" : "attempt";
    restoreForm.querySelector(`input[name="restore-mode"][value="${mode}"]`).checked = true;
    loom.showFieldErrors(restoreForm, restoreErrors, {});
    for (const row of checkpointRows.querySelectorAll("tr.restoring")) row.classList.remove("restoring");
    checkpointRows.querySelector(`tr[data-checkpoint="${checkpoint.id}"]`).classList.add("restoring");
    restoreForm.hidden = false;
    showWorldSize();
    showRestoreAvailability();
    restoreForm.scrollIntoView({ block: "nearest" });
  }

  function closeRestore() {
    restoring = null;
    restoreForm.hidden = true;
    for (const row of checkpointRows.querySelectorAll("tr.restoring")) row.classList.remove("restoring");
  }

  function showRestoreAvailability() {
    const refused = restoreMode() === "attempt" && runIsActive();
    const why = refused
      ? `Attempt ${latestAttempt} is ${run.state}: a new attempt can start once it has finished ` +
        "(or been cancelled); a fork can start now."
      : "";
    restoreLaunch.disabled = launching || refused;
    restoreLaunch.title = why;
    restoreBusy.textContent = why;
    restoreBusy.hidden = !refused;
    document.getElementById("restore-name-field").hidden = restoreMode() !== "fork";
  }

  function showWorldSize() {
    const degree = (name) => {
      const value = Number(restoreForm.querySelector(`[data-path="${PARALLEL_PREFIX}${name}"]`).value);
      return Number.isInteger(value) && value >= 1 ? value : null;
    };
    const degrees = ["pp", "dp_replicate", "dp_shard", "cp", "tp"].map(degree);
    const output = document.getElementById("restore-world-size");
    if (degrees.includes(null)) {
      output.textContent = "";
      return;
    }
    const worldSize = degrees.reduce((product, value) => product * value, 1);
    const saved = restoring ? `, saved on ${restoring.world_size}` : "";
    output.textContent = `(${count(worldSize, "rank")}${saved})`;
    output.dataset.worldSize = worldSize;
  }

  // Only the fields the user changed go: the rest of the saved config's parallel section stays as it was.
  function changedLayout() {
    const parallel = {};
    for (const input of layoutInputs) {
      if (input.value === input.dataset.saved) continue;
      parallel[input.dataset.path.slice(PARALLEL_PREFIX.length)] = jsonValue(input);
    }
    return parallel;
  }

  // Numbers go as numbers and switches as booleans; what does not parse goes as typed, so the
  // schema answers it with its own message.
  function jsonValue(input) {
    const text = input.value.trim();
    if (input.dataset.type === "bool") return text === "true";
    return input.dataset.type === "number" ? numberOrText(text) : text;
  }

  function numberOrText(text) {
    const number = Number(text);
    return text !== "" && Number.isFinite(number) ? number : text;
  }

  async function launchRestore(event) {
    event.preventDefault();
    const mode = restoreMode();
    const body = { checkpoint: restoring.id, mode, parallel: changedLayout() };
    const steps = restoreSteps.value.trim();
    if (steps) body.steps = numberOrText(steps);
    if (mode === "fork" && restoreName.value.trim()) body.name = restoreName.value.trim();
    launching = true;
    showRestoreAvailability();
    try {
      const response = await loom.post(page.urls.restore, body);
      if (response.status === 201) {
        const created = await response.json();
        if (created.forked) {
          window.location.assign(`/runs/${created.run}/`);
          return;
        }
        closeRestore();
        scheduleDetails();
      } else if (response.status === 400) {
        loom.showFieldErrors(restoreForm, restoreErrors, (await response.json()).errors);
      } else {
        loom.showFieldErrors(restoreForm, restoreErrors, { restore: `HTTP ${response.status}` });
      }
    } catch (error) {
      loom.showFieldErrors(restoreForm, restoreErrors, { restore: error.message });
    } finally {
      launching = false;
      showRestoreAvailability();
    }
  }


  // ---- resilience ----

  function showResilience(figures) {
    const setText = (id, text) => (document.getElementById(id).textContent = text);
    setText("resilience-restarts", String(figures.restarts));
    setText("resilience-failed", String(figures.failed_attempts));
    setText("resilience-ettr", figures.ettr === null ? "–" : `${(figures.ettr * 100).toFixed(1)} %`);
    setText("resilience-rpo", figures.rpo_steps_mean === null ? "–" : `${figures.rpo_steps_mean.toFixed(1)} steps`);
    setText("resilience-rto", figures.rto_s_mean === null ? "–" : formatSeconds(figures.rto_s_mean));
    const stall = figures.checkpoint_stall_s;
    setText(
      "resilience-stall",
      stall.saves
        ? `mean ${formatSeconds(stall.mean)} · max ${formatSeconds(stall.max)} (${count(stall.saves, "save")})`
        : "no save yet",
    );
    setText("resilience-advice", adviceText(figures));
    const rows = figures.failures.map((failure) => {
      const row = document.createElement("tr");
      row.dataset.failedAttempt = failure.attempt;
      const cells = [
        `attempt ${failure.attempt}`,
        failure.kind || "unclassified",
        failure.last_step,
        failure.resumed_step,
        failure.rpo_steps,
        failure.rto_s === null ? "" : failure.rto_s.toFixed(1),
      ];
      for (const text of cells) row.appendChild(document.createElement("td")).textContent = text;
      return row;
    });
    document.getElementById("failure-rows").replaceChildren(...rows);
    document.getElementById("failures-table").hidden = rows.length === 0;
  }

  // The configured save interval beside the one Young and Daly's formula suggests from this run's
  // own failures and save cost.
  function adviceText(figures) {
    const steps = figures.configured_interval_steps;
    let configured = "not saving by step (checkpoint.interval_steps is 0)";
    if (steps) {
      configured = `saving every ${count(steps, "step")}`;
      if (figures.configured_interval_s !== null) configured += ` ≈ ${formatSeconds(figures.configured_interval_s)}`;
    }
    const advice = figures.young_daly;
    if (advice === null) {
      const why = figures.failed_attempts
        ? "no checkpoint saved yet: no save cost to advise from"
        : "no failure yet: no MTBF to advise from";
      return `${configured}; ${why}`;
    }
    const suggestion =
      advice.interval_steps === null
        ? `every ${formatSeconds(advice.interval_s)}`
        : `every ${count(advice.interval_steps, "step")} (${formatSeconds(advice.interval_s)})`;
    return (
      `${configured}; Young/Daly √(2·MTBF·C) with MTBF ${formatSeconds(advice.mtbf_s)}, ` +
      `C ${formatSeconds(advice.save_cost_s)} suggests ${suggestion}`
    );
  }

  // ---- small helpers ----

  function badge(state) {
    const element = document.createElement("span");
    element.className = `badge state-${state}`;
    element.textContent = state;
    return element;
  }

  function link(href, text) {
    const element = document.createElement("a");
    element.href = href;
    element.textContent = text;
    return element;
  }

  function paragraph(text, className) {
    const element = document.createElement("p");
    element.className = className;
    element.textContent = text;
    return element;
  }

  function count(number, noun) {
    return `${number} ${noun}${number === 1 ? "" : "s"}`;
  }

  function showNotice(text) {
    notice.textContent = text;
    notice.hidden = false;
  }

  function hideNotice() {
    notice.hidden = true;
  }

  // The charts' snapshot, then the logs, states and checkpoints stored up to its seq (the events
  // of other kinds up to it are in the snapshot), then whatever came after.
  async function load() {
    let after = 0;
    for (;;) {
      try {
        const snapshotSeq = Math.min(
          ...(await Promise.all([charts.loadSnapshot(), ...(experts ? [experts.loadSnapshot()] : [])])),
        );
        if (prediction) measureSnapshot();
        let history;
        do {
          const query = `after=${after}&until=${snapshotSeq}&kinds=${HISTORY_KINDS}&limit=${EVENTS_PAGE_SIZE}`;
          history = await getJson(`${page.apiUrl}/events?${query}`);
          for (const event of history.events) apply(event);
          if (history.events.length) after = history.events[history.events.length - 1].seq;
        } while (history.more);
        run.lastSeq = snapshotSeq;
        run.snapshotSeq = snapshotSeq;
        hideNotice();
        return;
      } catch (error) {
        showNotice(`Could not load the run's charts (${error.message}); retrying.`);
        await new Promise((resolve) => setTimeout(resolve, RESYNC_RETRY_MS));
      }
    }
  }

  async function start() {
    const showChartError = (error) => showNotice(`Could not load a chart (${error.message}).`);
    charts.setUp(showChartError);
    experts?.setUp(showChartError);
    if (prediction) showPrediction();
    cancelButton.addEventListener("click", cancelRun);
    loadCapturedButton.addEventListener("click", loadCapturedLogs);
    rankSelect.addEventListener("change", showRank);
    restoreForm.addEventListener("submit", launchRestore);
    restoreForm.addEventListener("input", showWorldSize);
    restoreForm.addEventListener("change", showRestoreAvailability);
    document.getElementById("restore-close").addEventListener("click", closeRestore);
    window.addEventListener("hashchange", showTarget);
    await Promise.all([refreshDetails(), load()]);
    await resync();
    connect();
    setInterval(resyncWhenQuiet, QUIET_SOCKET_MS);
  }

  start();
})();
