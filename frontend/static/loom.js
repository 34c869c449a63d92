"use strict";
// What every page script shares: requests to loom's own API.

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

  return { post };
})();
