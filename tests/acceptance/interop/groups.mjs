// Publishes grouped tasks from Node.js with the official driver (docs/publishing.md, "Groups"):
// three groups of four, interleaved, one document at a time. A real mtask-worker runs them
// under the name's group limit (a sequence: one at a time per group, in publish order);
// tests/acceptance/test_groups_node.py checks the documents. Needs MONGODB_URI and MTASK_DATABASE.
import { MongoClient } from "mongodb";

const client = new MongoClient(process.env.MONGODB_URI);
const tasks = client.db(process.env.MTASK_DATABASE).collection("tasks");

for (let i = 0; i < 4; i++) {
  for (const group of ["tenant-a", "tenant-b", "tenant-c"]) {
    await tasks.updateOne(
      { _id: `${group}/${i}` },
      { $setOnInsert: { name: "timed_sleep", params: { seconds: 0.05 }, options: { group } } },
      { upsert: true },
    );
  }
}
console.log(JSON.stringify({ published: 12 }));
await client.close();
