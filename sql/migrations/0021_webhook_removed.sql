-- An endpoint removed from the INI: its undelivered deliveries used to stay
-- `pending` for ever (nobody claims an endpoint no host configures, retention keeps
-- undelivered rows, and with the endpoint's row gone no view counted them). Now the
-- endpoint's row stays, marked removed_at, while deliveries of it are kept: the sync
-- (webhook_endpoints_sync in sql/queries.sql) ends its undelivered ones `failed`
-- ("endpoint removed": counted, shown under the endpoint's name, replayable once it is
-- configured again) and drops the row once none is left. The outbox subscribes only
-- endpoints not removed (derivd_webhooks_on, derivd_outbox in sql/functions.sql).
--
-- A nullable column without a default: no rewrite of the (small) table.
ALTER TABLE derivd_webhook_endpoints ADD COLUMN removed_at timestamptz;

-- Endpoints removed before this migration left their rows without an endpoint: give them
-- one, removed, so that the next sync ends what they strand. One pass over the outbox,
-- which retention bounds.
INSERT INTO derivd_webhook_endpoints (name, events, removed_at)
SELECT DISTINCT d.endpoint, '{}'::text[], now()
  FROM derivd_deliveries AS d
 WHERE d.status IN ('pending', 'delivering', 'failed')
   AND NOT EXISTS (SELECT 1 FROM derivd_webhook_endpoints AS e WHERE e.name = d.endpoint);
