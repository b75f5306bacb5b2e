// Signals an mtask task from Node.js with the official driver and nothing else: the one
// updateOne(filter, pipeline) that docs/steps.md ("Signals from any language") documents, with
// the signal's name and JSON payload in place of the page's example ones
// (tests/acceptance/test_steps_node.py runs it, and checks that this update, the page's and
// mtask.store.steps.signal's are the same).
//
//   node signal.mjs URI DATABASE COLLECTION KEY NAME PAYLOAD_JSON
//     sends it; prints {"matchedCount": …, "modifiedCount": …}
//   node signal.mjs --print KEY NAME PAYLOAD_JSON
//     prints {"filter": …, "pipeline": …} without connecting
import { MongoClient } from "mongodb";

export function signalUpdate(key, name, payload) {
  // past 1,000 signals, only the one signal a waiting task still needs (docs/steps.md)
  const count = {
    $size: { $filter: { input: { $ifNull: ["$signals", []] }, cond: { $eq: ["$$this.name", name] } } },
  };
  const awaited = {
    $and: [
      { $eq: ["$status", "pending"] },
      { $eq: ["$waiting.signal", name] },
      { $lte: [count, "$waiting.nth"] },
    ],
  };
  const filter = {
    _id: key,
    status: { $in: ["pending", "running"] },
    $or: [{ "signals.999": { $exists: false } }, { $expr: awaited }],
  };
  const pipeline = [
    {
      $set: {
        signals: {
          $concatArrays: [
            { $ifNull: ["$signals", []] },
            [{ name: name, payload: { $literal: payload }, at: "$$NOW" }],
          ],
        },
        available_at: {
          $cond: [
            { $and: [{ $eq: ["$status", "pending"] }, { $eq: ["$waiting.signal", name] }] },
            "$$NOW",
            "$available_at",
          ],
        },
        next_claim_at: {
          $cond: [
            { $and: [{ $eq: ["$status", "pending"] }, { $eq: ["$waiting.signal", name] }] },
            "$$NOW",
            "$next_claim_at",
          ],
        },
        updated_at: "$$NOW",
      },
    },
  ];
  return { filter, pipeline };
}

const args = process.argv.slice(2);
if (args[0] === "--print") {
  const [, key, name, payload] = args;
  console.log(JSON.stringify(signalUpdate(key, name, JSON.parse(payload))));
} else {
  const [uri, database, collection, key, name, payload] = args;
  if (payload === undefined) {
    console.error("usage: node signal.mjs URI DATABASE COLLECTION KEY NAME PAYLOAD_JSON");
    process.exit(2);
  }
  const client = new MongoClient(uri);
  try {
    const tasks = client.db(database).collection(collection);
    const { filter, pipeline } = signalUpdate(key, name, JSON.parse(payload));
    const res = await tasks.updateOne(filter, pipeline);
    console.log(JSON.stringify({ matchedCount: res.matchedCount, modifiedCount: res.modifiedCount }));
  } finally {
    await client.close();
  }
}
