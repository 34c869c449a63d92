"use strict";
// The Nodes page's buttons: Exclude (with its reason) and Include, each through the API; the page reloads to
// show where things stand, and the API's field-level errors show beside the reason field (nothing changes then).

(() => {
  const notice = document.getElementById("nodes-notice");
  // Django refuses a DELETE without the CSRF token as it does a POST: the page carries one.
  const csrfToken = document.querySelector("[name=csrfmiddlewaretoken]").value;

  async function exclude(row, form) {
    const button = form.querySelector("button[type=submit]");
    const errors = form.querySelector(".form-errors");
    button.disabled = true;
    try {
      const response = await loom.post(row.dataset.excludeUrl, { reason: form.elements.reason.value });
      if (response.ok) {
        form.reset();
        location.reload();
        return;
      }
      const answer = await response.json().catch(() => ({}));
      loom.showFieldErrors(form, errors, answer.errors || { node: `HTTP ${response.status}` });
    } catch (error) {
      loom.showFieldErrors(form, errors, { node: error.message });
    } finally {
      button.disabled = false;
    }
  }

  async function include(row, button) {
    button.disabled = true;
    let problem;
    try {
      const response = await fetch(row.dataset.excludeUrl, {
        method: "DELETE",
        credentials: "same-origin",
        headers: { Accept: "application/json", "X-CSRFToken": csrfToken },
      });
      if (response.ok) {
        location.reload();
        return;
      }
      problem = `HTTP ${response.status}`;
    } catch (error) {
      problem = error.message;
    }
    button.disabled = false;
    notice.textContent = `Could not include node ${row.dataset.node}: ${problem}`;
    notice.hidden = false;
  }

  for (const row of document.querySelectorAll("tr.node")) {
    const form = row.querySelector(".exclude-form");
    form?.addEventListener("submit", (submit) => {
      submit.preventDefault();
      exclude(row, form);
    });
    const button = row.querySelector(".include-node");
    button?.addEventListener("click", () => include(row, button));
  }
})();
