"use strict";
// The webhooks page's actions: add a webhook, the API's field-level errors shown beside the fields (nothing is
// added then), and delete one. Each goes through the API and the page reloads to show where things stand.

(() => {
  const page = JSON.parse(document.getElementById("webhooks-page").textContent);
  const form = document.getElementById("webhook-form");
  // What names no field of the form (a failed request, say) goes in this list above it.
  const formErrors = document.getElementById("webhook-errors");
  const notice = document.getElementById("webhooks-notice");

  form.addEventListener("submit", async (submit) => {
    submit.preventDefault();
    const button = form.querySelector("button[type=submit]");
    button.disabled = true;
    // The API takes a run as its id, a number; null for all the user's runs.
    const run = form.elements.run.value;
    const body = { url: form.elements.url.value, run: run ? Number(run) : null };
    try {
      const response = await loom.post(page.urls.webhooks, body);
      if (response.status === 201) {
        // Emptied first, or the browser would put the added address back into the field on reload.
        form.reset();
        location.reload();
        return;
      }
      const answer = await response.json().catch(() => ({}));
      const errors = answer.errors || { webhook: `HTTP ${response.status}` };
      loom.showFieldErrors(form, formErrors, errors);
    } catch (error) {
      loom.showFieldErrors(form, formErrors, { webhook: error.message });
    } finally {
      button.disabled = false;
    }
  });

  // Django refuses a DELETE without the CSRF token as it does a POST: the form carries one.
  const csrfToken = form.elements.csrfmiddlewaretoken.value;

  async function remove(card) {
    const url = card.querySelector(".webhook-url").textContent;
    if (!confirm(`Delete the webhook to ${url} and the record of its deliveries?`)) return;
    let problem;
    try {
      const response = await fetch(page.urls.webhook.replace(/\/0$/, `/${card.dataset.webhook}`), {
        method: "DELETE",
        credentials: "same-origin",
        headers: { Accept: "application/json", "X-CSRFToken": csrfToken },
      });
      // A 404: it is gone already (deleted from another tab, say).
      if (response.ok || response.status === 404) {
        location.reload();
        return;
      }
      problem = `HTTP ${response.status}`;
    } catch (error) {
      problem = error.message;
    }
    notice.textContent = `Could not delete the webhook to ${url}: ${problem}`;
    notice.hidden = false;
  }

  for (const card of document.querySelectorAll(".webhook")) {
    card.querySelector(".delete-webhook").addEventListener("click", () => remove(card));
  }
})();
