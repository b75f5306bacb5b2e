// Publishes one task with encrypted params from Node.js, with the official MongoDB driver's
// explicit encryption (mongodb-client-encryption's ClientEncryption): the params document
// encrypted whole, AEAD_AES_256_CBC_HMAC_SHA_512-Random, under the data key named "mtask" of
// <database>.mtask_keys, stored as {"__mtask_encrypted__": <BinData 6>} (docs/publishing.md).
// argv: URI DATABASE KEY_FILE (96 bytes, base64) TASK_KEY PARAMS_JSON
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { MongoClient } from "mongodb";

const require = createRequire(import.meta.url);
const { ClientEncryption } = require("mongodb-client-encryption");
const [uri, database, keyFile, key, paramsJson] = process.argv.slice(2);
const master = Buffer.from(readFileSync(keyFile, "utf8").trim(), "base64");
const client = new MongoClient(uri);
try {
  await client.connect();
  const encryption = new ClientEncryption(client, {
    keyVaultNamespace: `${database}.mtask_keys`,
    kmsProviders: { local: { key: master } },
  });
  const params = JSON.parse(paramsJson);
  const sealed = await encryption.encrypt(params, {
    algorithm: "AEAD_AES_256_CBC_HMAC_SHA_512-Random",
    keyAltName: "mtask",
  });
  await client.db(database).collection("tasks").insertOne({
    _id: key,
    name: "echo",
    params: { __mtask_encrypted__: sealed },
  });
  console.log(JSON.stringify({ published: key, subtype: sealed.sub_type }));
} finally {
  await client.close();
}
