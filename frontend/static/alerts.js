"use strict";
// On every page of a logged-in user: a toast for each alert of their runs as it opens (and a short note as
// one resolves), heard over /ws/alerts/. The alerts themselves live on the run list and the run's triage.

window.loomAlerts = (() => {
  const state = { socket: null, opened: 0, toasts: [], retryMs: 1000 };
  // A warning fades after this long; a critical alert stays until dismissed.
  const WARNING_TOAST_MS = 20000;
  const RESOLVED_TOAST_MS = 6000;
  const RETRY_MAX_MS = 30000;

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

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const socket = new WebSocket(`${scheme}://${location.host}/ws/alerts/`);
    state.socket = socket;
    socket.addEventListener("open", () => {
      state.opened += 1;
      state.retryMs = 1000;
    });
    socket.addEventListener("message", (message) => {
      const data = JSON.parse(message.data);
      if (data.type === "alert" && (data.change === "opened" || data.change === "resolved")) toast(data.change, data.alert);
    });
    socket.addEventListener("close", () => {
      setTimeout(connect, state.retryMs);
      state.retryMs = Math.min(RETRY_MAX_MS, state.retryMs * 2);
    });
  }

  if (document.body.dataset.user) connect();
  return state;
})();
