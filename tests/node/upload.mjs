// An upload service in Node, using derivd through its SQL contract and its webhooks only.
// Env: DATABASE_URL, WEBHOOK_SECRET, PORT, IMAGE (a path), PREFIX (where the app keeps
// originals), and the store: S3_ENDPOINT + BUCKET (s3), or FS_ROOT (the fs store).
import { mkdir, open, readFile, rename } from "node:fs/promises";
import { createServer } from "node:http";
import { randomBytes, randomUUID } from "node:crypto";
import { extname, join } from "node:path";
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

// The store: S3 (versioned bucket), or the fs store's layout, a contract too:
// <root>/<key>.versions/<version><the key's extension>, written whole, then renamed.
const fsPath = (key, version) => join(env.FS_ROOT, `${key}.versions`, version + extname(key));
async function put(key, body) {
  if (!env.FS_ROOT) {
    const put = await s3.send(new PutObjectCommand({ Bucket: env.BUCKET, Key: key, Body: body }));
    return put.VersionId;
  }
  const version = `${Date.now()}000000`.padStart(20, "0") + randomBytes(4).toString("hex");
  await mkdir(join(env.FS_ROOT, `${key}.versions`), { recursive: true });
  const temp = fsPath(key, `.tmp-${version}`);
  const file = await open(temp, "w");
  await file.writeFile(body);
  await file.sync(); // durable before the row names it
  await file.close();
  await rename(temp, fsPath(key, version));
  return version;
}
async function get(bucket, key, version) {
  if (env.FS_ROOT) return readFile(fsPath(key, version));
  const got = await s3.send(new GetObjectCommand({ Bucket: bucket, Key: key })); // a plain GET
  return got.Body.transformToByteArray();
}

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

// 1. The upload: store the original where the app keeps originals.
const key = `${env.PREFIX}uploads/${randomUUID()}.jpg`;
const version = await put(key, await readFile(env.IMAGE));
// 2. Queue it: one INSERT, with the app's own id and metadata.
await db.connect();
const { rows: [row] } = await db.query(
  `INSERT INTO archive_files (status, original_key, original_version, external_id, metadata)
   VALUES ('queued', $1, $2, $3, $4) RETURNING id`,
  [key, version, "photo-42", { album: "holidays", owner: 7 }]);
// 3. file.ready arrives (verified); every variant opens by the bucket and key it names.
const data = await readyOf(String(row.id));
const variants = [];
for (const v of data.variants) {
  variants.push({ key: v.key, bytes: (await get(data.bucket, v.key, v.version)).length });
}
// 4. The app deletes the file (derivd removes its original and variants after a guard).
const { rows: [gone] } = await db.query("SELECT derivd_delete_file($1) AS status", [row.id]);
console.log(JSON.stringify({ id: row.id, key, external_id: data.external_id,
  metadata: data.metadata, original_key: data.original_key, bucket: data.bucket, variants,
  deleted: gone.status }));
await db.end();
server.close();
