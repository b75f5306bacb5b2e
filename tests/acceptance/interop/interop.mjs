// Publishes task documents from Node.js with the official driver, as a service in another
// language would (docs/publishing.md), waits for one outcome through a change stream, waits
// until every document is settled, and prints them as JSON lines (tests/acceptance/interop/test_node.py
// checks them). Needs MONGODB_URI and MTASK_DATABASE; a real mtask-worker runs the tasks.
import { MongoClient } from "mongodb";

const FINISHED = ["succeeded", "failed", "cancelled", "invalid"];
const client = new MongoClient(process.env.MONGODB_URI);
const db = client.db(process.env.MTASK_DATABASE);
const tasks = db.collection("tasks");

async function publish(key, name, params, extra = {}) {
  const res = await tasks.updateOne(
    { _id: key },
    { $setOnInsert: { name, params, ...extra } },
    { upsert: true },
  );
  return res.upsertedCount === 1;
}

async function waitFor(key, timeoutMs) {
  const stream = tasks.watch([{ $match: { "documentKey._id": key } }], {
    fullDocument: "updateLookup",
  });
  const timer = setTimeout(() => stream.close(), timeoutMs);
  try {
    await stream.tryNext(); // opens the stream: nothing slips between it and the read
    let doc = await tasks.findOne({ _id: key });
    while (!doc || !FINISHED.includes(doc.status)) {
      const change = await stream.next();
      doc = change.fullDocument ?? (await tasks.findOne({ _id: key }));
    }
    return doc;
  } finally {
    clearTimeout(timer);
    await stream.close();
  }
}

const serverNow = (await db.command({ hello: 1 })).localTime;
const soon = new Date(serverNow.getTime() + 500);
const full = {
  name: "add",
  params: { a: 20, b: 22 },
  options: {
    priority: 0, concurrency: 1, ping_interval_ms: 500, worker_timeout_ms: 5000,
    specific_worker_ids: [], max_retries: 3, retry_delay_ms: 100, retry_backoff: 2.0,
    max_retry_delay_ms: 60000, run_at: null,
  },
  status: "pending", next_claim_at: serverNow, available_at: serverNow,
  attempts: 0, successes: 0, failures: 0, failed_permanently: false,
  runs: [], runs_folded: 0, result: null, error: null,
  created_at: serverNow, updated_at: serverNow, finished_at: null,
};
const isoFull = {
  ...full, next_claim_at: serverNow.toISOString(), available_at: serverNow.toISOString(),
  created_at: serverNow.toISOString(), updated_at: serverNow.toISOString(),
};

const waiting = waitFor("node-min", 90000); // opened before the task exists
await new Promise((resolve) => setTimeout(resolve, 200));
const created = [
  await publish("node-min", "add", { a: 1, b: 2 }),
  await publish("node-min", "add", { a: 100, b: 200 }), // the same key again: no change
  await publish("node-full", full.name, full.params, (({ name, params, ...rest }) => rest)(full)),
  await publish("node-delayed", "add", { a: 2, b: 2 }, { run_at: soon }),
  await publish("node-prio", "add", { a: 3, b: 3 }, { options: { priority: 9, max_retries: 0 } }),
  await publish("node-retry", "flaky", { fail_times: 1 }, { options: { retry_delay_ms: 50 } }),
  await publish("node-iso", "add", { a: 1, b: 1 }, { run_at: soon.toISOString() }),
  await publish("node-full-iso", "add", { a: 1, b: 1 }, (({ name, params, ...r }) => r)(isoFull)),
  await publish("node-typo", "add", { a: 1, b: 1 }, { options: { max_retry: 3 } }),
  await publish("node-junk", 42, "not an object"),
  await publish("node-no-name", undefined, { a: 1 }),
];
const first = await waiting;
console.log(JSON.stringify({ event: "created", created }));
console.log(JSON.stringify({ event: "waited", key: first._id, status: first.status, result: first.result }));

const keys = ["node-min", "node-full", "node-delayed", "node-prio", "node-retry", "node-iso",
  "node-full-iso", "node-typo", "node-junk", "node-no-name"];
for (const key of keys) {
  const doc = await waitFor(key, 90000);
  console.log(JSON.stringify({ event: "settled", key, status: doc.status,
    result: doc.result ?? null, invalid_reason: doc.invalid_reason ?? null }));
}
await client.close();
