"use strict";
// What every page script shares: requests to loom's own API, and messages beside form fields.

window.loom = (() => {
  function cookie(name) {
    const entry = document.cookie.split("; ").find((item) => item.startsWith(`${name}=`));
    return entry ? decodeURIComponent(entry.slice(name.length + 1)) : "";
  }

  // A same-origin POST that asks for JSON back, with the CSRF token Django refuses a POST without;
  // `body`, when given, goes as JSON.
  function post(url, body) {
    const headers = { Accept: "application/json", "X-CSRFToken": cookie("csrftoken") };
    const request = { method: "POST", credentials: "same-origin", headers };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      request.body = JSON.stringify(body);
    }
    return fetch(url, request);
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

  return { post, clearFieldMessages, placeFieldMessage, showFieldErrors, listItem };
})();
