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
  if (url) {
    // the page shows the action's answer; its address does not keep it (a reload would
    // show it again): only where the answer is shown (at) stays
    const settled = new URL(url);
    for (const key of MESSAGE_KEYS) if (key !== "at") settled.searchParams.delete(key);
    history.replaceState(null, "", settled.pathname + settled.search);
  }
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
  // a fold with a form the person opened (the reset's step): not swapped under them
  if (document.querySelector("#content details[open] form")) return;
  const url = new URL(location.href);
  for (const key of MESSAGE_KEYS) if (key !== "at") url.searchParams.delete(key);
  const note = document.getElementById("note");
  const said = note ? note.innerHTML : "";
  const response = await fetch(url, { credentials: "same-origin" });
  if (!response.ok) return;
  swap(await response.text());
  // the answer to an action stays on the page until the person leaves it, but a reload (the
  // address without it) does not show it again
  const fresh = document.getElementById("note");
  if (fresh && said && !fresh.innerHTML.trim()) fresh.innerHTML = said;
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

// where the dashboard is mounted ("" at a server's root): <body data-root>
const ROOT = document.body.dataset.root || "";
const PAGE = location.pathname.slice(ROOT.length) || "/";
const REFRESHED = ["/", "/ui/workers", "/ui/limits"];
if (REFRESHED.includes(PAGE)) setInterval(refresh, 5000);
// a task page while the task is open: its progress and newest log lines, every 2 seconds
if (PAGE.startsWith("/ui/tasks/")) {
  setInterval(() => { if (document.querySelector("[data-live]")) refresh(); }, 2000);
}
