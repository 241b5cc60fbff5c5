// An upload service in Node, using derivd through its SQL contract and its webhooks only.
// Env: DATABASE_URL, S3_ENDPOINT, BUCKET, PREFIX, WEBHOOK_SECRET, PORT, IMAGE (a path).
import { readFile } from "node:fs/promises";
import { createServer } from "node:http";
import { randomUUID } from "node:crypto";
import pg from "pg";
import { S3Client, PutObjectCommand, GetObjectCommand } from "@aws-sdk/client-s3";
import { Webhook } from "standardwebhooks";

const env = process.env;
const s3 = new S3Client({ endpoint: env.S3_ENDPOINT, region: "us-east-1", forcePathStyle: true });
const db = new pg.Client({ connectionString: env.DATABASE_URL });
const hooks = new Webhook(env.WEBHOOK_SECRET);
const arrived = new Map(); // file id -> the data of its verified file.ready
const waiting = new Map(); // file id -> who waits for it
const readyOf = (id) => arrived.get(id) ?? new Promise((resolve) => waiting.set(id, resolve));

const server = createServer(async (req, res) => {
  let body = "";
  for await (const chunk of req) body += chunk;
  try {
    const event = hooks.verify(body, req.headers); // throws unless signed with our secret
    res.writeHead(204).end();
    if (event.type === "file.ready") {
      const id = String(event.data.file_id);
      arrived.set(id, event.data);
      waiting.get(id)?.(event.data);
    }
  } catch {
    res.writeHead(400).end();
  }
});
server.listen(Number(env.PORT), "127.0.0.1");

// 1. The upload: PUT the original where the app keeps originals, under its prefix.
const key = `${env.PREFIX}uploads/${randomUUID()}.jpg`;
const put = await s3.send(new PutObjectCommand({
  Bucket: env.BUCKET, Key: key, Body: await readFile(env.IMAGE), ContentType: "image/jpeg" }));
// 2. Queue it: one INSERT, with the app's own id and metadata.
await db.connect();
const { rows: [row] } = await db.query(
  `INSERT INTO archive_files (status, original_key, original_version, external_id, metadata)
   VALUES ('queued', $1, $2, $3, $4) RETURNING id`,
  [key, put.VersionId, "photo-42", { album: "holidays", owner: 7 }]);
// 3. file.ready arrives (verified); every variant opens by the bucket and key it names.
const data = await readyOf(String(row.id));
const variants = [];
for (const v of data.variants) {
  const got = await s3.send(new GetObjectCommand({ Bucket: data.bucket, Key: v.key }));
  variants.push({ key: v.key, bytes: (await got.Body.transformToByteArray()).length });
}
// 4. The app deletes the file (derivd removes its original and variants after a guard).
const { rows: [gone] } = await db.query("SELECT derivd_delete_file($1) AS status", [row.id]);
console.log(JSON.stringify({ id: row.id, key, external_id: data.external_id,
  metadata: data.metadata, original_key: data.original_key, variants, deleted: gone.status }));
await db.end();
server.close();
