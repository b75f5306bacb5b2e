// Progressive enhancement: every action is a plain form that works without JavaScript
// (POST, then redirect to a page with a flash message). With JavaScript, forms are submitted
// in place (the redirected page's content replaces this one's), and the overview, limits and
// workers pages refresh themselves every 5 seconds (an open task's page every 2).
"use strict";

const MESSAGE_KEYS = ["flash", "problem", "confirm", "at", "sig", "payload"];

function swap(html, url) {
  const page = new DOMParser().parseFromString(html, "text/html");
  const fresh = page.getElementById("content");
  if (!fresh) return;
  document.getElementById("content").replaceWith(fresh);
  if (url && url !== location.href) history.replaceState(null, "", url);
  // a form's answer shown beside the form (the signal form's): bring it into view
  const note = document.querySelector("form #note .flash");
  if (note) note.scrollIntoView({ block: "nearest" });
}

async function refresh() {
  if (document.activeElement && document.activeElement.matches("input, select, textarea")) return;
  // a form's refused input and its problem stay until the person acts on them
  if (document.querySelector("form #note .flash.error")) return;
  const typed = document.querySelector("form.signal textarea");
  if (typed && typed.value) return;
  const url = new URL(location.href);
  for (const key of MESSAGE_KEYS) url.searchParams.delete(key);
  const response = await fetch(url, { credentials: "same-origin" });
  if (!response.ok) return;
  swap(await response.text());
  // the message was the answer to an action: a reload must not show it again
  history.replaceState(null, "", url.pathname + url.search);
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

const REFRESHED = ["/", "/ui/workers", "/ui/limits"];
if (REFRESHED.includes(location.pathname)) setInterval(refresh, 5000);
// a task page while the task is open: its progress and newest log lines, every 2 seconds
if (location.pathname.startsWith("/ui/tasks/")) {
  setInterval(() => { if (document.querySelector("[data-live]")) refresh(); }, 2000);
}
