// Reads mtask serve's Server-Sent Events with Node's own fetch (no npm package), resuming with
// Last-Event-ID. Usage: node sse.mjs BASE_URL TOKEN NAME COUNT [LAST_EVENT_ID]
// Prints one JSON line per event ({id, data}) and "open" once the stream is open; exits after
// COUNT events.
const [base, token, name, countText, lastId] = process.argv.slice(2);
const count = Number(countText);
const headers = { Authorization: `Bearer ${token}`, Accept: "text/event-stream" };
if (lastId) headers["Last-Event-ID"] = lastId;
const controller = new AbortController();
const response = await fetch(`${base}/events?name=${encodeURIComponent(name)}`, {
  headers,
  signal: controller.signal,
});
if (response.status !== 200) {
  console.log(JSON.stringify({ status: response.status, body: await response.text() }));
  process.exit(3);
}
const decoder = new TextDecoder();
let buffer = "";
let seen = 0;
for await (const chunk of response.body) {
  buffer += decoder.decode(chunk, { stream: true });
  let end;
  while ((end = buffer.indexOf("\n\n")) >= 0) {
    const block = buffer.slice(0, end);
    buffer = buffer.slice(end + 2);
    if (block === ": open") console.log("open");
    const fields = {};
    for (const line of block.split("\n")) {
      if (line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      if (colon < 0) continue;
      fields[line.slice(0, colon)] = line.slice(colon + 1).replace(/^ /, "");
    }
    if (fields.event === "task") {
      console.log(JSON.stringify({ id: fields.id, data: JSON.parse(fields.data) }));
      seen += 1;
      if (seen >= count) {
        controller.abort();
        process.exit(0);
      }
    }
  }
}
process.exit(4);
