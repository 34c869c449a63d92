"use strict";
// What every page script shares: requests to loom's own API, messages beside form fields, and bytes
// written in binary units.

window.loom = (() => {
  function cookie(name) {
    const entry = document.cookie.split("; ").find((item) => item.startsWith(`${name}=`));
    return entry ? decodeURIComponent(entry.slice(name.length + 1)) : "";
  }

  // A same-origin write (POST, PATCH) that asks for JSON back, with the CSRF token Django refuses a write
  // without; `body`, when given, goes as JSON.
  function send(method, url, body) {
    const headers = { Accept: "application/json", "X-CSRFToken": cookie("csrftoken") };
    const request = { method, credentials: "same-origin", headers };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      request.body = JSON.stringify(body);
    }
    return fetch(url, request);
  }

  function post(url, body) {
    return send("POST", url, body);
  }

  function patch(url, body) {
    return send("PATCH", url, body);
  }

  // A field's messages go in the `.field-error` / `.field-warning` element whose data-for names it
  // ("config.parallel.tp"), inside the form's container; its `.input` is marked while it has an error.
  function clearFieldMessages(container) {
    for (const element of container.querySelectorAll(".field-error, .field-warning")) {
      element.textContent = "";
      element.hidden = true;
    }
    for (const element of container.querySelectorAll(".input.has-error")) element.classList.remove("has-error");
  }

  // False where no element names the field, so the caller shows the message somewhere else.
  function placeFieldMessage(container, field, message, className) {
    const element = container.querySelector(`.${className}[data-for="${field}"]`);
    if (!element) return false;
    element.textContent = element.textContent ? `${element.textContent} ${message}` : message;
    element.hidden = false;
    if (className === "field-error") element.closest(".input")?.classList.add("has-error");
    return true;
  }

  // Each error beside the field it names; what names no field goes in `list` (a <ul> above the form),
  // which is hidden when there is none.
  function showFieldErrors(form, list, errors) {
    clearFieldMessages(form);
    const unplaced = Object.entries(errors)
      .filter(([field, message]) => !placeFieldMessage(form, field, message, "field-error"))
      .map(([field, message]) => `${field}: ${message}`);
    list.replaceChildren(...unplaced.map(listItem));
    list.hidden = unplaced.length === 0;
  }

  function listItem(text) {
    const item = document.createElement("li");
    item.textContent = text;
    return item;
  }

  // ---- bytes, in binary units on every page ----

  // Plotly's SI suffixes write 5e10 bytes as "50G" and 50 bytes as "50": bytes are always written
  // here in powers of 1,024 with the unit named (512 B, 3.0 KiB, 12.5 MiB, 1.07 GiB).
  const BYTE_UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];

  function formatBytes(bytes) {
    if (bytes === null || bytes === undefined || !Number.isFinite(bytes)) return "";
    const unit = byteUnit(bytes);
    const value = bytes / 1024 ** unit;
    if (unit === 0) return `${Math.round(value)} B`;
    return `${value.toFixed(unit >= 3 ? 2 : 1)} ${BYTE_UNITS[unit]}`;
  }

  // The largest binary unit (as a power of 1,024) that keeps `bytes` at 1 or more.
  function byteUnit(bytes) {
    const magnitude = Math.abs(bytes);
    return magnitude < 1 ? 0 : Math.min(BYTE_UNITS.length - 1, Math.floor(Math.log2(magnitude) / 10));
  }

  // An axis or colour bar over bytes from `low` to `high`: about `count` ticks at round multiples of
  // one binary unit (1.5 GiB, 2 GiB, 2.5 GiB), as Plotly's tickvals and ticktext.
  function byteTicks(low, high, count = 5) {
    if (!Number.isFinite(low) || !Number.isFinite(high)) return { tickvals: [], ticktext: [] };
    const unitSize = 1024 ** byteUnit(Math.max(Math.abs(low), Math.abs(high)));
    const raw = (high - low) / count / unitSize;
    if (!(raw > 0)) return { tickvals: [low], ticktext: [formatBytes(low)] };
    const decade = 10 ** Math.floor(Math.log10(raw));
    const step = [1, 2, 5, 10].map((factor) => factor * decade).find((candidate) => candidate >= raw) * unitSize;
    const decimals = Math.max(0, -Math.floor(Math.log10(step / unitSize)));
    const unitName = BYTE_UNITS[Math.round(Math.log2(unitSize) / 10)];
    const tickvals = [];
    for (let tick = Math.ceil(low / step) * step; tick <= high + step * 1e-9; tick += step) tickvals.push(tick);
    const ticktext = tickvals.map((tick) => `${(tick / unitSize).toFixed(decimals)} ${unitName}`);
    return { tickvals, ticktext };
  }

  // The same over log10(bytes) from `low` to `high` (a log colour scale): ticks at powers of two
  // (32 KiB, 1 MiB, 32 MiB), at most `count`, their values in log10 as the scale is.
  function logByteTicks(low, high, count = 8) {
    const first = Math.ceil(low / Math.log10(2));
    const last = Math.floor(high / Math.log10(2));
    const stride = [1, 2, 5, 10, 20, 30, 40, 50].find((candidate) => (last - first) / candidate < count) || 60;
    const tickvals = [];
    const ticktext = [];
    for (let power = Math.ceil(first / stride) * stride; power <= last; power += stride) {
      const unit = Math.min(BYTE_UNITS.length - 1, Math.floor(power / 10));
      tickvals.push(power * Math.log10(2));
      ticktext.push(`${2 ** (power - unit * 10)} ${BYTE_UNITS[unit]}`);
    }
    return { tickvals, ticktext };
  }

  return {
    post,
    patch,
    clearFieldMessages,
    placeFieldMessage,
    showFieldErrors,
    listItem,
    BYTE_UNITS,
    byteUnit,
    formatBytes,
    byteTicks,
    logByteTicks,
  };
})();
