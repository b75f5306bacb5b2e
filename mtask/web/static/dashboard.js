// Progressive enhancement: every action is a plain form that works without JavaScript
// (POST, then redirect to a page with a flash message). With JavaScript, forms are submitted
// in place (the redirected page's content replaces this one's), and the overview and workers
// pages refresh themselves every 5 seconds (an open task's page every 2).
"use strict";

function swap(html, url) {
  const page = new DOMParser().parseFromString(html, "text/html");
  const fresh = page.getElementById("content");
  if (!fresh) return;
  document.getElementById("content").replaceWith(fresh);
  if (url && url !== location.href) history.replaceState(null, "", url);
}

async function refresh() {
  if (document.activeElement && document.activeElement.matches("input, select")) return;
  const url = new URL(location.href);
  url.searchParams.delete("flash");
  url.searchParams.delete("problem");
  const response = await fetch(url, { credentials: "same-origin" });
  if (response.ok) swap(await response.text());
}

document.addEventListener("submit", async (event) => {
  const form = event.target;
  if ((form.getAttribute("method") || "").toLowerCase() !== "post" || form.classList.contains("logout")) return;
  event.preventDefault();
  for (const b of form.querySelectorAll("button")) b.disabled = true;
  // (form.action would be the input named "action": read the attribute)
  const response = await fetch(form.getAttribute("action"), {
    method: "POST",
    credentials: "same-origin",
    headers: { "Content-Type": "application/x-www-form-urlencoded" },
    body: new URLSearchParams(new FormData(form)),
  });
  swap(await response.text(), response.url);
});

if (location.pathname === "/" || location.pathname === "/ui/workers") setInterval(refresh, 5000);
// a task page while the task is open: its progress and newest log lines, every 2 seconds
if (location.pathname.startsWith("/ui/tasks/")) {
  setInterval(() => { if (document.querySelector("[data-live]")) refresh(); }, 2000);
}
