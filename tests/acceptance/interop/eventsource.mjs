// Reads a task's live output from mtask serve with the `eventsource` npm package (the
// WHATWG EventSource for Node.js), resuming with Last-Event-ID.
// Usage: node eventsource.mjs BASE_URL TOKEN KEY COUNT [LAST_EVENT_ID]
// Prints "open", then one JSON line per chunk ({id, data}); after COUNT chunks (0: all) it
// closes, or on `end` prints {"end": {...}} and closes.
import { EventSource } from "eventsource";

const [base, token, key, countText, lastId] = process.argv.slice(2);
const count = Number(countText);
const url = `${base}/tasks/${encodeURIComponent(key)}:stream?kind=chunk`;
const source = new EventSource(url, {
  fetch: (input, init) => {
    const headers = { ...(init?.headers ?? {}), Authorization: `Bearer ${token}` };
    // the first connection resumes after LAST_EVENT_ID; the library sets it on a reconnect
    if (lastId && !("Last-Event-ID" in headers) && !("last-event-id" in headers)) {
      headers["Last-Event-ID"] = lastId;
    }
    return fetch(input, { ...init, headers });
  },
});
let seen = 0;
source.onopen = () => console.log("open");
source.addEventListener("chunk", (event) => {
  console.log(JSON.stringify({ id: event.lastEventId, data: JSON.parse(event.data) }));
  seen += 1;
  if (count && seen >= count) {
    source.close();
    process.exit(0);
  }
});
source.addEventListener("end", (event) => {
  console.log(JSON.stringify({ end: JSON.parse(event.data) }));
  source.close();
  process.exit(0);
});
source.onerror = (event) => {
  if (source.readyState === EventSource.CLOSED) {
    console.log(JSON.stringify({ error: String(event.message ?? event.code ?? "closed") }));
    process.exit(3);
  }
};
