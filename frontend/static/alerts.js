"use strict";
// On every page of a logged-in user: a toast for each alert of their runs as it opens (and a short note as
// one resolves), heard over /ws/alerts/. The alerts themselves live on the run list and the run's triage.
// A websocket message can be lost (a full channel, a reconnect, the page changing), so the page also asks the
// socket, on every connect and every resync_s, for the alerts opened since it last asked; the tab remembers
// which alerts it has shown, so each opened alert is toasted once across the tab's pages.

window.loomAlerts = (() => {
  const state = { socket: null, opened: 0, toasts: [], replays: 0, retryMs: 1000 };
  // A warning fades after this long; a critical alert stays until dismissed.
  const WARNING_TOAST_MS = 20000;
  const RESOLVED_TOAST_MS = 6000;
  const RETRY_MAX_MS = 30000;
  // Each replay asks from this long before the last one answered: an alert whose transaction committed late
  // still comes; the shown ones are dropped.
  const REPLAY_OVERLAP_MS = 120000;
  const SEEN_KEPT = 200;
  const storage = window.sessionStorage;
  const seen = new Set(JSON.parse(storage.getItem("loomAlertsSeen") || "[]"));

  function remember(alert) {
    seen.add(alert.id);
    storage.setItem("loomAlertsSeen", JSON.stringify([...seen].slice(-SEEN_KEPT)));
  }

  function opened(alert) {
    if (seen.has(alert.id)) return;
    remember(alert);
    toast("opened", alert);
  }

  function stack() {
    let element = document.getElementById("toasts");
    if (!element) {
      element = document.createElement("div");
      element.id = "toasts";
      element.setAttribute("role", "status");
      element.setAttribute("aria-live", "polite");
      document.body.append(element);
    }
    return element;
  }

  function toast(change, alert) {
    const item = document.createElement("div");
    item.className = `toast ${change === "resolved" ? "resolved" : alert.severity}`;
    item.dataset.alert = alert.id;
    item.dataset.rule = alert.rule;
    const title = document.createElement("strong");
    const where = alert.rank === null ? "" : ` · rank ${alert.rank}${alert.host ? ` on ${alert.host}` : ""}`;
    title.textContent = `${change === "resolved" ? "Resolved: " : ""}${alert.rule.replace(/_/g, " ")}${where}`;
    const text = document.createElement("p");
    text.textContent = change === "resolved" ? alert.resolution : alert.message;
    const link = document.createElement("a");
    link.href = alert.triage_url;
    link.textContent = `${alert.run_name}: triage`;
    const close = document.createElement("button");
    close.type = "button";
    close.className = "link-button toast-close";
    close.setAttribute("aria-label", "dismiss");
    close.textContent = "×";
    close.addEventListener("click", () => item.remove());
    item.append(close, title, text, link);
    stack().append(item);
    state.toasts.push({ change, alert });
    const fadeMs = change === "resolved" ? RESOLVED_TOAST_MS : alert.severity === "critical" ? null : WARNING_TOAST_MS;
    if (fadeMs !== null) setTimeout(() => item.remove(), fadeMs);
  }

  function askForReplay(socket) {
    if (socket.readyState === WebSocket.OPEN) {
      socket.send(JSON.stringify({ type: "replay", since: storage.getItem("loomAlertsSince") }));
    }
  }

  function heard(socket, data) {
    if (data.type === "hello") {
      // A new tab starts from now, by the platform's clock; a tab's later pages from where it left off.
      if (!storage.getItem("loomAlertsSince")) storage.setItem("loomAlertsSince", data.now);
      askForReplay(socket);
      state.resync = setInterval(() => askForReplay(socket), data.resync_s * 1000);
    } else if (data.type === "replay") {
      state.replays += 1;
      data.alerts.forEach(opened);
      const since = Date.parse(data.now) - REPLAY_OVERLAP_MS;
      if (!(Date.parse(storage.getItem("loomAlertsSince")) >= since)) {
        storage.setItem("loomAlertsSince", new Date(since).toISOString());
      }
    } else if (data.type === "alert" && data.change === "opened") {
      opened(data.alert);
    } else if (data.type === "alert" && data.change === "resolved") {
      toast("resolved", data.alert);
    }
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const socket = new WebSocket(`${scheme}://${location.host}/ws/alerts/`);
    state.socket = socket;
    socket.addEventListener("open", () => {
      state.opened += 1;
      state.retryMs = 1000;
    });
    socket.addEventListener("message", (message) => heard(socket, JSON.parse(message.data)));
    socket.addEventListener("close", () => {
      clearInterval(state.resync);
      setTimeout(connect, state.retryMs);
      state.retryMs = Math.min(RETRY_MAX_MS, state.retryMs * 2);
    });
  }

  if (document.body.dataset.user) connect();
  return state;
})();
