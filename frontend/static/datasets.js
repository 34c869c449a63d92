"use strict";
// The Datasets page: its forms go to the API (errors beside their fields), and imports still converting are
// asked after until they are ready or failed.

(() => {
  const page = JSON.parse(document.getElementById("datasets-page").textContent);
  const POLL_MS = 2000;

  function submitTo(form, url) {
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const body = { name: form.elements.name.value, path: form.elements.path.value };
      const response = await loom.post(url, body);
      if (response.ok) {
        window.location.reload();
        return;
      }
      const answer = await response.json().catch(() => ({ errors: { request: response.statusText } }));
      loom.showFieldErrors(form, form.querySelector(".form-errors"), answer.errors || {});
    });
  }

  async function followImports() {
    const pending = [...document.querySelectorAll("#models tr[data-state='queued'], #models tr[data-state='converting']")];
    if (pending.length === 0) return;
    for (const row of pending) {
      const id = row.id.replace("model-", "");
      const response = await fetch(page.modelUrl.replace(/0$/, id), { headers: { Accept: "application/json" } });
      if (!response.ok) continue;
      const model = await response.json();
      if (model.state !== row.dataset.state) {
        window.location.reload();
        return;
      }
    }
    setTimeout(followImports, POLL_MS);
  }

  submitTo(document.getElementById("register-dataset"), page.datasetsUrl);
  submitTo(document.getElementById("import-model"), page.modelsUrl);
  followImports();
})();
