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
      const errors = answer.errors ? Object.values(answer.errors).join("; ") : answer.detail || response.statusText;
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
      const checkpoint = Number(click.currentTarget.dataset.checkpoint);
      act(page.urls.restore, { checkpoint, mode: "attempt" }, () => {
        location.href = page.urls.run;
      });
    });
  }
  document.getElementById("cancel-run")?.addEventListener("click", () =>
    act(page.urls.cancel, undefined, () => location.reload()),
  );
})();
