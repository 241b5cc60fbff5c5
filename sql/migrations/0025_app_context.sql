-- The app's contract (DESIGN.md "For upload APIs"):
--
-- 1. A file carries the app's own context: `external_id` (its reference, text) and
--    `metadata` (a small JSON object), both optional, carried unchanged to the client's
--    result, `derivd show` and every webhook. Their bounds are rules of the row
--    (derivd_file_row_holds in sql/functions.sql): an INSERT from any language meets
--    the same ones. Nullable columns without a default: no rewrite of the table.
ALTER TABLE archive_files ADD COLUMN external_id text, ADD COLUMN metadata jsonb;

-- 2. Where the originals and variants live, as an app and a receiver name it: the
--    store's backend and bucket, recorded by `derivd migrate` and by every supervisor at
--    start, read by the outbox (the `bucket` of each webhook) and the client's result.
CREATE TABLE derivd_store (
    one        boolean     PRIMARY KEY DEFAULT true,
    backend    text        NOT NULL,
    bucket     text,
    updated_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT derivd_store_one_row CHECK (one)
);

-- 3. Keys are the store's real keys: until now `[storage] prefix` (s3) was added inside
--    the store, so every key in the database lacked it and named no object an app could
--    GET. From now on the rows hold the whole key: the key the app PUT, and the keys
--    derivd writes under its prefix. `derivd migrate` passes the configured prefix as
--    the transaction's `derivd.key_prefix` (empty: nothing to do; an empty database has
--    no rows). Hosts of the release before add the prefix once more: with a prefix set,
--    stop them all before this migration.
DO $$
DECLARE
    p text := coalesce(current_setting('derivd.key_prefix', true), '');
BEGIN
    IF p = '' THEN
        RETURN;
    END IF;
    UPDATE archive_files SET original_key = p || original_key,
                             derived_key = p || derived_key;
    UPDATE archive_variants SET key = p || key;
    UPDATE pending_objects SET key = p || key;
    UPDATE derivd_retired_objects SET key = p || key;
    UPDATE derivd_rederivations SET original_key = p || original_key;
END $$;

-- 4. The host registry knows which variant set each supervisor derives (a digest of its
--    configured set: derivd.fingerprint.target_digest), so `derivd backfill` can refuse
--    to roll out a set that live hosts do not run: their workers would reject every
--    re-derivation. NULL: a host of the release before (unknown).
ALTER TABLE derivd_hosts ADD COLUMN variant_set text;

-- 5. A queued row names its original by a key and a version (derivd reads originals by
--    version; an empty one named nothing and was rejected by the worker later). The row
--    rule now refuses it at the INSERT; queued rows that break it are rejected here as
--    the worker would have, with their event and webhooks.
DO $$
DECLARE
    ids bigint[];
BEGIN
    WITH bad AS (
        UPDATE archive_files
           SET status = 'rejected', error_code = 'missing_original', finished_at = now(),
               updated_at = now()
         WHERE status = 'queued'
           AND (original_key = '' OR coalesce(original_version, '') = '')
        RETURNING id, attempts
    ), logged AS (
        INSERT INTO archive_events (file_id, kind, attempt, error_code, actor)
        SELECT id, 'rejected', attempts, 'missing_original', 'migrate' FROM bad
    )
    SELECT array_agg(id) INTO ids FROM bad;
    -- (The outbox is the previous release's functions.sql: present wherever rows are.)
    IF ids IS NOT NULL AND to_regprocedure('derivd_outbox_many(bigint[], text)') IS NOT NULL THEN
        PERFORM derivd_outbox_many(ids, 'file.rejected');
    END IF;
END $$;
