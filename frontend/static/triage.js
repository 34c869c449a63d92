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
