"use strict";
// The run list's filters apply as soon as one is picked (the search box on Enter or Apply); each change starts
// again from the first page, as the form carries no cursor.

(() => {
  const form = document.getElementById("run-filters");
  for (const input of form.querySelectorAll("select, input[type=checkbox]")) {
    input.addEventListener("change", () => form.requestSubmit());
  }
})();
