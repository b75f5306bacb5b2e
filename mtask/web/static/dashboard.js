// Buttons call the API (the session cookie carries the token); the page's content is
// refreshed in place every 3 seconds without a reload.
"use strict";

async function refresh() {
  const response = await fetch(location.href, { credentials: "same-origin" });
  if (!response.ok) return;
  const page = new DOMParser().parseFromString(await response.text(), "text/html");
  const fresh = page.getElementById("content");
  if (fresh) document.getElementById("content").replaceWith(fresh);
}

async function post(button) {
  button.disabled = true;
  const note = document.getElementById("note");
  try {
    const response = await fetch(button.dataset.post, { method: "POST", credentials: "same-origin" });
    const body = await response.json().catch(() => ({}));
    note.textContent = response.ok ? "done" : `${response.status}: ${JSON.stringify(body.detail ?? body)}`;
    note.className = response.ok ? "ok" : "error";
  } finally {
    await refresh();
  }
}

document.addEventListener("click", (event) => {
  const button = event.target.closest("button[data-post]");
  if (button) post(button);
});

setInterval(refresh, 3000);
