-- Webhooks an app can trust: a webhook-id no other database sends, one file's events in
-- the order they happened, and an endpoint circuit that probes one POST at a time.
--
-- webhook_id: fixed when the event is written, the same on every retry and replay, and
-- globally unique (`msg_` and a random UUID's 32 hex digits): the row id was a counter
-- of this database, so a second one (staging, a rebuilt or restored one) sent `msg_1`
-- again to a receiver that dedupes by it. Rows written before keep the id they were
-- sent with (`msg_<id>`), so that a replay of one is still recognised. Added without a
-- default first (no rewrite), filled, then given the default for new rows; the outbox
-- is bounded by retention.
ALTER TABLE derivd_deliveries ADD COLUMN webhook_id text;
UPDATE derivd_deliveries SET webhook_id = 'msg_' || id;
ALTER TABLE derivd_deliveries
    ALTER COLUMN webhook_id SET DEFAULT 'msg_' || replace(gen_random_uuid()::text, '-', ''),
    ALTER COLUMN webhook_id SET NOT NULL;

-- The per-file `sequence` of every payload (derivd_outbox): one counter for every event
-- of the database, so a file's events carry increasing numbers in the order they
-- happened (a file's events are serialised by its row's lock).
CREATE SEQUENCE derivd_event_sequence AS bigint;

-- The circuit: opened_at (NULL: closed) once `threshold` attempts in a row failed;
-- while open, no claim before paused_until, then one probe at a time (probe_token: the
-- lease token of the probe in flight, until probe_until); probes: failed probes since
-- it opened, which the pause doubles with. Nullable columns and a constant default: no
-- rewrite.
ALTER TABLE derivd_webhook_endpoints
    ADD COLUMN opened_at timestamptz,
    ADD COLUMN probes integer NOT NULL DEFAULT 0,
    ADD COLUMN probe_token uuid,
    ADD COLUMN probe_until timestamptz;
