"use strict";
// The run page's own labels: its name, tags and note edited in a form, and Archive / Unarchive. Each goes
// through PATCH on the run's API; a bad field is shown beside its input and nothing changes.

(() => {
  const page = JSON.parse(document.getElementById("run-page").textContent);
  const form = document.getElementById("run-edit-form");
  const formErrors = document.getElementById("run-edit-errors");
  const editButton = document.getElementById("edit-run");
  const archiveButton = document.getElementById("archive-run");
  const notice = document.getElementById("page-notice");

  // The run as the API answered it: the heading, the tags, the note and the archive button follow it.
  function show(run) {
    document.getElementById("run-name").textContent = run.name;
    document.title = `${run.name} · loom`;
    document.getElementById("run-tags").replaceChildren(...run.tags.map(tagLink));
    const note = document.getElementById("run-note");
    note.replaceChildren(...run.note.split("\n").flatMap((line, index) => (index ? [document.createElement("br"), line] : [line])));
    note.hidden = !run.note;
    archiveButton.dataset.archived = String(run.archived);
    archiveButton.textContent = run.archived ? "Unarchive" : "Archive";
    document.getElementById("archived-notice").hidden = !run.archived;
    form.elements.name.value = run.name;
    form.elements.tags.value = run.tags.join(", ");
    form.elements.note.value = run.note;
  }

  function tagLink(tag) {
    const link = document.createElement("a");
    link.className = "tag";
    link.href = `${page.urls.runList}?tag=${encodeURIComponent(tag)}`;
    link.textContent = tag;
    return link;
  }

  // The answer's run, or null once its errors are shown (`showErrors`) or in the page's notice.
  async function edit(body, showErrors) {
    try {
      const response = await loom.patch(page.apiUrl, body);
      const answer = await response.json().catch(() => ({}));
      if (response.ok) return answer;
      showErrors(answer.errors || { run: `HTTP ${response.status}` });
    } catch (error) {
      showErrors({ run: error.message });
    }
    return null;
  }

  function showNotice(errors) {
    notice.textContent = Object.entries(errors).map(([field, message]) => `${field}: ${message}`).join("; ");
    notice.hidden = false;
  }

  editButton.addEventListener("click", () => {
    loom.clearFieldMessages(form);
    formErrors.hidden = true;
    form.hidden = false;
    editButton.hidden = true;
    form.elements.name.focus();
  });

  document.getElementById("run-edit-cancel").addEventListener("click", () => {
    form.hidden = true;
    editButton.hidden = false;
  });

  form.addEventListener("submit", async (submit) => {
    submit.preventDefault();
    const save = document.getElementById("run-edit-save");
    save.disabled = true;
    const tags = form.elements.tags.value.split(/[\s,]+/).filter((tag) => tag);
    const body = { name: form.elements.name.value, tags, note: form.elements.note.value };
    const run = await edit(body, (errors) => loom.showFieldErrors(form, formErrors, errors));
    save.disabled = false;
    if (!run) return;
    show(run);
    form.hidden = true;
    editButton.hidden = false;
  });

  archiveButton.addEventListener("click", async () => {
    archiveButton.disabled = true;
    const run = await edit({ archived: archiveButton.dataset.archived !== "true" }, showNotice);
    archiveButton.disabled = false;
    if (run) show(run);
  });
})();
