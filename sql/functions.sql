-- Every function of derivd's schema, as it is now: `derivd migrate` runs this whole file
-- after the pending migrations, on every run, in the migrations' transaction and under
-- their lock (so two hosts never replace the same function at once, and a body that
-- does not fit the tables rolls the whole upgrade back). Change a function here, not in a
-- migration; migrations do what only they can (tables, columns, indexes, data moves).
--
-- Signatures are a contract with every host of the fleet, including hosts still on the
-- previous release during a rolling upgrade: name, argument names and types and result
-- columns stay as they are (CREATE OR REPLACE refuses to change them anyway). A new
-- shape is a new function next to the old one; the old one goes (a migration's DROP, and
-- out of this file) once no release calls it. Bodies may change freely.
--
-- Order matters only for the SQL-language functions, whose bodies the server checks when
-- they are created: each comes after what it calls.

-- == Why the lease protocol runs in functions ===========================================
-- At claim_batch = 1 the server's CPU per job was mostly parsing and planning large CTE
-- statements (2.5x more through a transaction pooler, where nothing can be prepared).
-- PL/pgSQL prepares each statement of a function once per server connection and keeps
-- the plan, whichever client (or pooler) calls it; the client sends one small
-- `SELECT * FROM derivd_x(...)`. Each body is a few short statements whose plans are
-- primary-key or partial-index lookups.
--
-- The fence: a commit, failure or release changes a row only while it is `processing`
-- under the caller's token (a failed fence appends `lease_lost`); every claimed row gets
-- its own fresh token and lease; times are the database's. The fence is written
-- `id = ... AND lease_token = token`: archive_files_lease_check (schema.sql) makes a row
-- hold a lease token exactly while it is `processing`, so the token match is the status
-- check, and it keeps the plan on the primary key (with `status = 'processing'` spelled
-- out, a generic plan may scan the partial index of every processing row). The queries
-- of sql/queries.sql that check a lease are written the same way.
--
-- #variable_conflict use_column: inside the bodies an unqualified name is a column (the
-- OUT parameters of RETURNS TABLE share their names with columns).
--
-- plan_cache_mode = force_generic_plan: every statement inside is planned once per server
-- connection, its plan kept (left to choose, the server re-planned custom plans for some
-- statements at every call). The plans are index lookups whatever the parameters: the
-- primary key, or the partial indexes of queued and processing rows. A function's SET
-- clause undoes every local setting made inside it on return, which is why the claim's
-- synchronous_commit is set by the calling statement (`claim` in sql/queries.sql), not
-- in derivd_claim.

-- == archive_files' row rules ==========================================================

-- archive_files' one CHECK (migrations 0020, 0022): every rule a row must hold, in one
-- function of the whole row. A table CHECK is read back from its stored text and
-- prepared again by every statement that writes the table (claims and commits included):
-- seven of them cost ~12 % of a job's server CPU; one call of a function, compiled once
-- per connection, costs a fraction of that, and one whole-row argument instead of the
-- fifteen columns a fraction again (~3 % of a noop job's server instructions: a column
-- reference is a long node in that text). `record`, not archive_files: this file is read
-- before the table exists when the schema is built from the files (tests/test_schema.py).
-- A broken rule raises check_violation under the constraint name it had as a CHECK of
-- its own (as psycopg's diag.constraint_name reports it).
-- The app's context on a file (README "For upload APIs"): what is wrong with this
-- external id and metadata, in one line, or NULL when they are fine (both NULL too).
-- The one copy of their bounds: the row's rule below, and what derivd.client and
-- `derivd enqueue` ask before they write. external_id: 1-200 characters, no control
-- characters. metadata: a JSON object, at most 4096 bytes as JSON text.
CREATE OR REPLACE FUNCTION derivd_app_context_problem(external_id text, metadata jsonb)
RETURNS text
LANGUAGE sql IMMUTABLE AS $$
SELECT CASE
    WHEN external_id IS NOT NULL AND NOT (char_length(external_id) BETWEEN 1 AND 200)
        THEN 'external_id must be 1-200 characters, not '
             || char_length(external_id)
    WHEN external_id ~ '[[:cntrl:]]'
        THEN 'external_id must hold no control characters'
    WHEN metadata IS NOT NULL AND jsonb_typeof(metadata) <> 'object'
        THEN 'metadata must be a JSON object, not a JSON ' || jsonb_typeof(metadata)
    WHEN octet_length(metadata::text) > 4096
        THEN 'metadata must be at most 4096 bytes as JSON text, not '
             || octet_length(metadata::text)
END;
$$;

CREATE OR REPLACE FUNCTION derivd_file_row_holds(r record)
RETURNS boolean
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    broken text;
BEGIN
    -- Each rule as its CHECK had it (NULL passes, as in a CHECK), the first broken one
    -- named. One CASE, not one IF per rule: a plpgsql expression is prepared again in
    -- every transaction, and each of a job's two UPDATEs calls this.
    broken := CASE
        WHEN (r.status::derivd_status IS NOT NULL) IS FALSE THEN 'archive_files_status_check'
        WHEN (r.error_code IS NULL OR r.error_code::derivd_error_code IS NOT NULL) IS FALSE
            THEN 'archive_files_error_code_check'
        -- A lease exists exactly while a row is processing: the fence relies on it (a
        -- token match is a status check: derivd_commit_outcomes).
        WHEN ((r.status = 'processing')
              = (r.lease_token IS NOT NULL AND r.lease_until IS NOT NULL)) IS FALSE
            THEN 'archive_files_lease_check'
        WHEN ((r.status = 'rejected') = (r.error_code IS NOT NULL)) IS FALSE
            THEN 'archive_files_rejected_has_code'
        WHEN (r.attempts >= 0) IS FALSE THEN 'archive_files_attempts_check'
        WHEN (r.priority::derivd_priority IS NOT NULL
              AND (r.tenant IS NULL OR r.tenant::derivd_tenant IS NOT NULL)) IS FALSE
            THEN 'archive_files_traffic_check'
        -- The analysis: all eight or none. The worker checks the same before it commits
        -- (derivd.analysis_rules): a handler's malformed analysis fails its own job,
        -- never the commit. colour: "#rrggbb", lower case; placeholder: ThumbHash (17-25
        -- bytes) in base64, padding optional; format: a short lower-case name.
        WHEN (num_nulls(r.original_width, r.original_height, r.original_format,
                        r.original_frames, r.original_has_alpha, r.original_colour,
                        r.original_placeholder, r.original_dhash) = 8
              OR (r.original_width > 0 AND r.original_height > 0 AND r.original_frames > 0
                  AND r.original_format ~ '^[a-z0-9]{1,16}$'
                  AND r.original_has_alpha IS NOT NULL
                  AND r.original_colour ~ '^#[0-9a-f]{6}$'
                  AND r.original_placeholder ~ '^[A-Za-z0-9+/]{16,64}={0,2}$'
                  AND r.original_dhash IS NOT NULL)) IS FALSE
            THEN 'archive_files_original_check'
        -- A queued row names its original by key and version (derivd reads originals
        -- by version): an INSERT without them is refused here, not rejected later.
        WHEN (r.status <> 'queued'
              OR (r.original_key <> '' AND coalesce(r.original_version, '') <> '')) IS FALSE
            THEN 'archive_files_original_key_check'
        -- The app's context: derivd_app_context_problem, asked only of a row that has one.
        WHEN (r.external_id IS NOT NULL OR r.metadata IS NOT NULL)
             AND derivd_app_context_problem(r.external_id, r.metadata) IS NOT NULL
            THEN 'archive_files_app_context_check'
    END;
    IF broken IS NULL THEN
        RETURN true;
    END IF;
    IF broken = 'archive_files_app_context_check' THEN
        RAISE EXCEPTION 'new row for relation "archive_files" violates check constraint "%"',
                        broken
              USING ERRCODE = 'check_violation', CONSTRAINT = broken, TABLE = 'archive_files',
                    DETAIL = derivd_app_context_problem(r.external_id, r.metadata);
    END IF;
    RAISE EXCEPTION 'new row for relation "archive_files" violates check constraint "%"',
                    broken
          USING ERRCODE = 'check_violation', CONSTRAINT = broken, TABLE = 'archive_files';
END $$;

-- == Triggers ===========================================================================

-- archive_events is append-only: UPDATE, DELETE and TRUNCATE are refused (on every
-- partition: see derivd_guard_partition). Old days leave only by DROP of their partition.
CREATE OR REPLACE FUNCTION archive_events_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'archive_events is append-only';
END $$;

-- Wake idle workers at once: any row entering `queued` (from derivd or from an upload API
-- in any language) notifies `derivd_queued` (derivd.queue.db.QUEUED_CHANNEL). The payload
-- is constant, so PostgreSQL folds the notifications of one transaction into one, and a
-- bulk enqueue costs a single wake-up.
CREATE OR REPLACE FUNCTION archive_files_notify_queued() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('derivd_queued', '');
    RETURN NULL;
END $$;

-- The fair rank of a row as it is inserted (a `pending` row keeps it once queued): right
-- after its tenant's last queued row at its priority, and never before the frontier (the
-- lowest rank due at that priority). A tenant that arrives starts at the frontier, so
-- its rows interleave with those of a tenant that holds many: the claim, one ordered
-- scan, then alternates between them. Rows that come back to `queued` (retry, release,
-- operator retry) keep their rank. Ties (same rank) go by id.
CREATE OR REPLACE FUNCTION archive_files_fair_rank() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    last_rank bigint;
    frontier bigint;
BEGIN
    SELECT f.fair_rank INTO last_rank
      FROM archive_files AS f
     WHERE f.status = 'queued' AND f.priority = NEW.priority
       AND coalesce(f.tenant, '') = coalesce(NEW.tenant, '')
     ORDER BY f.priority, coalesce(f.tenant, ''), f.fair_rank DESC
     LIMIT 1;
    IF last_rank IS NOT NULL THEN
        -- The tenant has queued rows: they are at or past the frontier already (the
        -- frontier is the lowest due rank), so one descent is enough, the common case.
        NEW.fair_rank := last_rank + 1;
        RETURN NEW;
    END IF;
    SELECT f.fair_rank INTO frontier
      FROM archive_files AS f
     WHERE f.status = 'queued' AND f.priority = NEW.priority AND f.available_at <= now()
     ORDER BY f.priority DESC, f.fair_rank, f.id
     LIMIT 1;
    NEW.fair_rank := coalesce(frontier, 0);
    RETURN NEW;
END $$;

-- Tell a waiting upload API that its file is done: a row reaching a final state (ready,
-- rejected) or leaving the pipeline (deleting, deleted) notifies `derivd_finished`
-- (derivd.queue.db.FINISHED_CHANNEL) with its id as the payload, and nothing else (the
-- listener reads the row itself: derivd.client.wait). Only when someone registered in
-- derivd_waiters waits for it: a transaction that has sent a NOTIFY takes a lock on the
-- whole instance when it commits and holds it until its commit is on disk (so that
-- notifications appear in commit order); one NOTIFY per job would cap a database at one
-- commit per WAL flush, fleet-wide. Distinct payloads are not folded: a batch commit
-- sends one notification per registered row, when the committing transaction ends.
CREATE OR REPLACE FUNCTION archive_files_notify_finished() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM derivd_waiters AS w WHERE w.file_id = NEW.id) THEN
        PERFORM pg_notify('derivd_finished', NEW.id::text);
    END IF;
    RETURN NULL;
END $$;

-- == archive_events: daily partitions ===================================================

-- Row triggers are cloned onto every partition; a statement trigger is not, so each
-- partition gets its own TRUNCATE guard.
CREATE OR REPLACE FUNCTION derivd_guard_partition(part regclass) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE format('CREATE TRIGGER archive_events_no_truncate BEFORE TRUNCATE ON %s '
                   'FOR EACH STATEMENT EXECUTE FUNCTION archive_events_append_only()', part);
END $$;

-- Partitions are made 8 days ahead by the EventPartitions duty (derivd.processes.duties):
-- every supervisor at start and every [sweep] partitions_interval, and `derivd sweep`.
-- Each DDL statement below takes ACCESS EXCLUSIVE on archive_events, so the caller runs
-- each function under a short lock_timeout (derivd.queue.db.DDL_LOCK_TIMEOUT_S) and
-- retries later rather than queue every job's commit behind a long reader. Two hosts
-- doing this at once serialise on a transaction-scoped advisory lock (it holds through a
-- transaction pooler); the second finds nothing left to do.

-- Daily partitions for `days` days from `first` (UTC dates), unless present. Partition
-- `archive_events_to_YYYYMMDD` holds the day before that date. A day whose rows already
-- sit in the DEFAULT partition is left to derivd_rehome_default_events. Returns the
-- partitions created.
CREATE OR REPLACE FUNCTION derivd_event_partitions(first date, days integer)
RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE
    d date;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('derivd_event_partitions'));
    FOR i IN 0 .. days - 1 LOOP
        d := first + i;
        CONTINUE WHEN to_regclass('archive_events_to_' || to_char(d + 1, 'YYYYMMDD')) IS NOT NULL;
        CONTINUE WHEN EXISTS (SELECT 1 FROM archive_events_default
                               WHERE at >= d::timestamp AT TIME ZONE 'UTC'
                                 AND at < (d + 1)::timestamp AT TIME ZONE 'UTC');
        RETURN NEXT derivd_event_partition(d);
    END LOOP;
END $$;

-- The partition of one UTC day (created and guarded unless present); its name.
CREATE OR REPLACE FUNCTION derivd_event_partition(d date)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    part text := 'archive_events_to_' || to_char(d + 1, 'YYYYMMDD');
BEGIN
    IF to_regclass(part) IS NULL THEN
        EXECUTE format('CREATE TABLE %I PARTITION OF archive_events FOR VALUES FROM (%L) TO (%L)',
                       part, d::timestamp AT TIME ZONE 'UTC',
                       (d + 1)::timestamp AT TIME ZONE 'UTC');
        PERFORM derivd_guard_partition(part::regclass);
    END IF;
    RETURN part;
END $$;

-- Empty the DEFAULT partition after an outage of the partition rounds longer than the
-- days they make ahead (its rows would otherwise stay: the days it holds rows of can get
-- no partition, and with one recent row its old ones outlive retention). Its rows from
-- `cutoff` on (every row when cutoff is NULL: no retention) move to the partitions of
-- their days, ids kept; the older ones go with the old table. Returns the day partitions
-- that received rows (none when DEFAULT was empty).
CREATE OR REPLACE FUNCTION derivd_rehome_default_events(cutoff timestamptz)
RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE
    d date;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('derivd_event_partitions'));
    IF NOT EXISTS (SELECT 1 FROM archive_events_default) THEN
        RETURN;
    END IF;
    ALTER TABLE archive_events DETACH PARTITION archive_events_default;
    ALTER TABLE archive_events_default RENAME TO archive_events_default_old;
    CREATE TABLE archive_events_default PARTITION OF archive_events DEFAULT;
    PERFORM derivd_guard_partition('archive_events_default');
    FOR d IN SELECT DISTINCT (at AT TIME ZONE 'UTC')::date FROM archive_events_default_old
              WHERE cutoff IS NULL OR at >= cutoff ORDER BY 1 LOOP
        RETURN NEXT derivd_event_partition(d);
    END LOOP;
    INSERT INTO archive_events OVERRIDING SYSTEM VALUE
    SELECT * FROM archive_events_default_old
     WHERE cutoff IS NULL OR at >= cutoff ORDER BY id;
    DROP TABLE archive_events_default_old;
END $$;

-- Drop the partitions that end on or before `cutoff`, whole. Returns what it dropped.
-- (DEFAULT's old rows go with derivd_rehome_default_events.)
CREATE OR REPLACE FUNCTION derivd_drop_event_partitions(cutoff timestamptz)
RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE
    part text;
BEGIN
    FOR part IN
        SELECT c.relname::text
          FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'archive_events'::regclass
           AND c.relname ~ '^archive_events_to_[0-9]{8}$'
           AND to_date(right(c.relname, 8), 'YYYYMMDD')::timestamp AT TIME ZONE 'UTC' <= cutoff
         ORDER BY c.relname
    LOOP
        EXECUTE format('DROP TABLE %I', part);
        RETURN NEXT part;
    END LOOP;
END $$;

-- == The webhook outbox ==================================================================

-- The outbox (DESIGN.md "Webhooks"): one delivery per endpoint subscribed to `event` (and
-- to the file's tenant, when it names tenants) for this file, in the caller's
-- transaction, with the body as it will be POSTed and signed: {"type", "timestamp" (the
-- event's), "data": the file's id, tenant, status, error code and attempts, the app's
-- external_id and metadata, the original's bucket, key and version, and for
-- file.ready / file.rederived every variant (its key the store's own) and the analysis}. A re-derivation's job row
-- is no file of its own: it announces nothing (its commit announces file.rederived for
-- the file). Wakes the delivering processes (`derivd_deliveries`, constant payload: one
-- notification per transaction). Returns the deliveries inserted. An endpoint removed
-- from the INI (removed_at: kept while deliveries of it are) subscribes to nothing.
--
-- Every caller checks derivd_webhooks_on() first (derivd_outbox_many does), once per
-- call, so that without any endpoint a commit pays one probe of an empty table and no
-- function call per row.
-- (plpgsql, not sql: called from plpgsql, a SQL function's body is parsed and planned
-- again in every transaction, ~7 % of a noop job's server CPU; plpgsql keeps its plan.)
CREATE OR REPLACE FUNCTION derivd_webhooks_on() RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN EXISTS (SELECT 1 FROM derivd_webhook_endpoints AS e WHERE e.removed_at IS NULL);
END $$;

CREATE OR REPLACE FUNCTION derivd_outbox(file_id bigint, event text)
RETURNS integer
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
DECLARE
    n integer;
    seq bigint := nextval('derivd_event_sequence');  -- the payload's `sequence`
BEGIN
    INSERT INTO derivd_deliveries (endpoint, event, file_id, body)
    SELECT e.name, derivd_outbox.event, f.id,
           jsonb_build_object(
               'type', derivd_outbox.event,
               'timestamp', to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
               'data', jsonb_build_object(
                   'sequence', seq,
                   'file_id', f.id, 'tenant', f.tenant, 'status', f.status,
                   'error_code', f.error_code, 'attempts', f.attempts,
                   'external_id', f.external_id, 'metadata', f.metadata,
                   'bucket', (SELECT s.bucket FROM derivd_store AS s),
                   'original_key', f.original_key, 'original_version', f.original_version,
                   'variants', CASE WHEN derivd_outbox.event IN ('file.ready', 'file.rederived')
                       THEN coalesce((SELECT jsonb_agg(jsonb_build_object(
                                'name', v.name, 'format', v.format, 'key', v.key,
                                'version', v.version, 'content_type', v.content_type,
                                'width', v.width, 'height', v.height, 'bytes', v.bytes,
                                'sha256', v.sha256)
                              ORDER BY v.name, v.format)
                              FROM archive_variants AS v WHERE v.file_id = f.id), '[]') END,
                   'original', CASE WHEN derivd_outbox.event IN ('file.ready', 'file.rederived')
                                     AND f.original_width IS NOT NULL
                       THEN jsonb_build_object(
                           'width', f.original_width, 'height', f.original_height,
                           'format', f.original_format, 'frames', f.original_frames,
                           'has_alpha', f.original_has_alpha, 'colour', f.original_colour,
                           'placeholder', f.original_placeholder,
                           'dhash', f.original_dhash, 'media', f.original_media) END))::text
      FROM archive_files AS f
      JOIN derivd_webhook_endpoints AS e
        ON derivd_outbox.event = ANY (e.events)
       AND (e.tenants IS NULL OR f.tenant = ANY (e.tenants))
       AND e.removed_at IS NULL
     WHERE f.id = derivd_outbox.file_id AND f.rederive_of IS NULL;
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 THEN
        PERFORM pg_notify('derivd_deliveries', '');
    END IF;
    RETURN n;
END $$;

-- Whether a delivery waits its turn: one file's events reach an endpoint in the order
-- they happened, so a delivery waits while an earlier one of the same endpoint and file
-- is undelivered (pending or leased). Earlier is a smaller id: a file's events are
-- serialised by its row's lock, so the later one's row is inserted after the earlier
-- one's commit. The claim and `run --burst`'s wait ask it of each candidate row, through
-- the file's index.
CREATE OR REPLACE FUNCTION derivd_delivery_waits(endpoint text, file_id bigint, id bigint)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM derivd_deliveries AS d
                    WHERE d.file_id = derivd_delivery_waits.file_id
                      AND d.endpoint = derivd_delivery_waits.endpoint
                      AND d.id < derivd_delivery_waits.id
                      AND d.status IN ('pending', 'delivering'));
$$;

-- Closes an endpoint's circuit (the first success: a delivery, `derivd webhooks test`,
-- or `derivd webhooks resume`): no failures, no pause, no probe. When it was open, its
-- backlog flows at once: every pending delivery of it is due now (their own backoff grew
-- while the receiver was away), and the delivering processes are woken. Returns whether
-- it was open (the caller logs or says so).
CREATE OR REPLACE FUNCTION derivd_circuit_close(endpoint text)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    was_open boolean;
BEGIN
    SELECT e.opened_at IS NOT NULL OR coalesce(e.paused_until > now(), false) INTO was_open
      FROM derivd_webhook_endpoints AS e
     WHERE e.name = derivd_circuit_close.endpoint
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE derivd_webhook_endpoints AS e
       SET failures = 0, opened_at = NULL, probes = 0, paused_until = NULL,
           probe_token = NULL, probe_until = NULL
     WHERE e.name = derivd_circuit_close.endpoint
       AND (e.failures > 0 OR e.opened_at IS NOT NULL OR e.paused_until IS NOT NULL
            OR e.probe_token IS NOT NULL);
    IF was_open THEN
        UPDATE derivd_deliveries AS d
           SET available_at = now()
         WHERE d.endpoint = derivd_circuit_close.endpoint AND d.status = 'pending'
           AND d.available_at > now();
        PERFORM pg_notify('derivd_deliveries', '');
    END IF;
    RETURN was_open;
END $$;

-- The outbox for several files at once (the statements of sql/queries.sql that reject
-- or delete rows call it in their own transaction, right after: QueueDB).
CREATE OR REPLACE FUNCTION derivd_outbox_many(ids bigint[], event text)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    n integer := 0;
    i bigint;
BEGIN
    IF NOT derivd_webhooks_on() THEN
        RETURN 0;
    END IF;
    FOREACH i IN ARRAY coalesce(ids, '{}') LOOP
        n := n + derivd_outbox(i, event);
    END LOOP;
    RETURN n;
END $$;

-- == The lease protocol =================================================================

-- The fenced commit of one or more finished attempts (`jobs`: a JSON array of {id,
-- token, attempt, derived_key, derived_version, sha256, width, height, variants,
-- original_width, original_height, original_format, original_frames, original_has_alpha,
-- original_colour, original_placeholder, original_dhash, original_media}; the analysis
-- keys absent, as from a handler that analyses nothing or a host of a release before
-- 0013 (original_media: before 0026, or an image): NULLs; each
-- variant {name, format, content_type, key, version, sha256, width, height, fingerprint,
-- bytes}, `bytes` absent from a host of a release before 0019: NULL). Each
-- row passes or fails its own fence. A file's fenced UPDATE and its `ready` event are one
-- statement; for a row that passes, its variants are recorded and, when it stored some,
-- its attempt's write-ahead entries cleared (an attempt registers pending objects
-- exactly for the variants it PUTs). An id no file holds under its token goes to
-- derivd_commit_rederivation (a re-derivation's swap, which takes exactly its run's
-- configured set or rejects the job; else `lease_lost`). Returns each id with its
-- outcome: 'committed', 'rejected' (a re-derivation whose set was refused) or 'lost'.
-- Durable: its caller leaves synchronous_commit alone.
CREATE OR REPLACE FUNCTION derivd_commit_outcomes(jobs jsonb)
RETURNS TABLE (id bigint, outcome text)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
DECLARE
    j record;
    n integer;
    hooks boolean;  -- any webhook endpoint: asked once, after the first commit passes
BEGIN
    FOR j IN
        SELECT *
          FROM jsonb_to_recordset(jobs)
               AS x(id bigint, token uuid, attempt integer, derived_key text,
                    derived_version text, sha256 text, width integer, height integer,
                    variants jsonb, original_width integer, original_height integer,
                    original_format text, original_frames integer,
                    original_has_alpha boolean, original_colour text,
                    original_placeholder text, original_dhash bigint,
                    original_media jsonb)
    LOOP
        -- The fence and the attempt's `ready` event in one statement.
        WITH done AS (
            UPDATE archive_files AS f
               SET status = 'ready',
                   derived_key = j.derived_key,
                   derived_version = j.derived_version,
                   sha256 = j.sha256,
                   width = j.width,
                   height = j.height,
                   original_width = j.original_width,
                   original_height = j.original_height,
                   original_format = j.original_format,
                   original_frames = j.original_frames,
                   original_has_alpha = j.original_has_alpha,
                   original_colour = j.original_colour,
                   original_placeholder = j.original_placeholder,
                   original_dhash = j.original_dhash,
                   original_media = j.original_media,
                   error_code = NULL,
                   lease_token = NULL,
                   lease_until = NULL,
                   finished_at = now(),
                   updated_at = now()
             WHERE f.id = j.id AND f.lease_token = j.token  -- the fence (see the top)
            RETURNING f.attempts)
        INSERT INTO archive_events AS e (file_id, kind, attempt, lease_token)
        SELECT j.id, 'ready', d.attempts, j.token FROM done AS d
        RETURNING e.attempt INTO n;
        IF n IS NULL THEN
            id := j.id;
            -- The same commit sent again (derivd.worker, `_commit_again`: the first
            -- sending's answer was lost) finds its attempt's work committed: the row
            -- `ready` at this attempt (a later claim would have counted one more), with
            -- this attempt's variants. Nothing is written twice.
            PERFORM 1 FROM archive_files AS f
             WHERE f.id = j.id AND f.status = 'ready' AND f.attempts = j.attempt
               AND (jsonb_array_length(coalesce(j.variants, '[]')) = 0
                    OR EXISTS (SELECT 1 FROM archive_variants AS v
                                WHERE v.file_id = j.id AND v.lease_token = j.token));
            IF FOUND THEN
                outcome := 'committed';
                RETURN NEXT;
                CONTINUE;
            END IF;
            -- No file holds this lease: a re-derivation's (one id space), or lost (the
            -- `lease_lost` event is written there). A file pays for this only on a
            -- failed fence.
            outcome := derivd_commit_rederivation(to_jsonb(j));
            RETURN NEXT;
            CONTINUE;
        END IF;
        IF jsonb_array_length(coalesce(j.variants, '[]')) > 0 THEN
            INSERT INTO archive_variants AS a (file_id, name, format, content_type, key,
                                               version, sha256, width, height, lease_token,
                                               fingerprint, bytes)
            SELECT j.id, v.name, v.format, v.content_type, v.key,
                   v.version, v.sha256, v.width, v.height, j.token, v.fingerprint, v.bytes
              FROM jsonb_to_recordset(j.variants)
                   AS v(name text, format text, content_type text, key text,
                        version text, sha256 text, width integer, height integer,
                        fingerprint text, bytes bigint)
            ON CONFLICT (file_id, name, format) DO UPDATE
               SET key = EXCLUDED.key, version = EXCLUDED.version,
                   sha256 = EXCLUDED.sha256, width = EXCLUDED.width,
                   height = EXCLUDED.height, content_type = EXCLUDED.content_type,
                   lease_token = EXCLUDED.lease_token, fingerprint = EXCLUDED.fingerprint,
                   bytes = EXCLUDED.bytes, created_at = now();
            DELETE FROM pending_objects WHERE lease_token = j.token;
        END IF;
        IF hooks IS NULL THEN
            hooks := derivd_webhooks_on();
        END IF;
        IF hooks THEN
            PERFORM derivd_outbox(j.id, 'file.ready');
        END IF;
        id := j.id;
        outcome := 'committed';
        RETURN NEXT;
    END LOOP;
END $$;

-- The claim's queued rows under [queue] max_in_flight_per_tenant = tenant_cap: up to
-- `wanted` due rows in claim order (by priority DESC, fair_rank, id; `oldest`: by
-- available_at, id), none of a tenant that has tenant_cap rows in flight counting this
-- call's own. Rows without a tenant are never capped. Each row comes back locked.
--
-- It finds a claimable row whenever one exists below the cap: the tenants at their cap
-- are read first from the `processing` rows (as many as the fleet holds in flight) and
-- the ordered scan skips exactly their rows, however many there are; a tenant met on the
-- way is then counted again under its lock, and one found at its cap joins them. How
-- far it looks: to the first due row of a tenant below the cap (past the queued rows of
-- tenants at the cap ahead of it, and no further). docs/traffic.md says why.
--
-- Each tenant's count is taken under a transaction-scoped advisory lock (held to the end
-- of the claim's transaction, so two claims of one tenant count each other's rows; it
-- holds through a transaction pooler). The lock is tried, never waited for: two claims
-- meeting two tenants in different orders (a ranked claim and an oldest-first turn)
-- would otherwise deadlock, rolling back the commit that shares their transaction. A
-- tenant whose lock another claim holds is that claim's to count: skipped here.
CREATE OR REPLACE FUNCTION derivd_pick_capped(wanted integer, tenant_cap integer,
                                              oldest boolean)
RETURNS TABLE (id bigint, since timestamptz, attempts integer)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
DECLARE
    capped text[];
    tried bigint[] := '{}';
    chosen text[] := '{}';
    c record;
    busy integer;
BEGIN
    SELECT coalesce(array_agg(b.tenant), '{}') INTO capped
      FROM (SELECT p.tenant
              FROM archive_files AS p
             WHERE p.status = 'processing' AND p.tenant IS NOT NULL
             GROUP BY p.tenant
            HAVING count(*) >= tenant_cap) AS b;
    -- Each turn excludes one more row or one more tenant: the loop ends.
    WHILE cardinality(chosen) < wanted LOOP
        IF oldest THEN
            SELECT f.id, f.available_at, f.attempts, f.tenant INTO c
              FROM archive_files AS f
             WHERE f.status = 'queued' AND f.available_at <= now()
               AND (f.tenant IS NULL OR f.tenant <> ALL (capped)) AND f.id <> ALL (tried)
             ORDER BY f.available_at, f.id
             LIMIT 1;
        ELSE
            SELECT f.id, f.available_at, f.attempts, f.tenant INTO c
              FROM archive_files AS f
             WHERE f.status = 'queued' AND f.available_at <= now()
               AND (f.tenant IS NULL OR f.tenant <> ALL (capped)) AND f.id <> ALL (tried)
             ORDER BY f.priority DESC, f.fair_rank, f.id
             LIMIT 1;
        END IF;
        EXIT WHEN NOT FOUND;
        tried := tried || c.id;
        IF c.tenant IS NOT NULL THEN
            IF NOT pg_try_advisory_xact_lock(hashtextextended('derivd.tenant:' || c.tenant, 0))
            THEN
                capped := capped || c.tenant;
                CONTINUE;
            END IF;
            -- In flight: committed claims (after the lock: each statement sees what
            -- the claims that held it before committed), plus this call's own.
            SELECT count(*) INTO busy
              FROM archive_files AS p
             WHERE p.status = 'processing' AND p.tenant = c.tenant;
            IF busy + cardinality(array_positions(chosen, c.tenant)) >= tenant_cap THEN
                capped := capped || c.tenant;
                CONTINUE;
            END IF;
        END IF;
        PERFORM 1 FROM archive_files AS q
         WHERE q.id = c.id AND q.status = 'queued'
           FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;  -- another claim has it
        chosen := chosen || c.tenant;
        id := c.id;
        since := c.available_at;
        attempts := c.attempts;
        RETURN NEXT;
    END LOOP;
END $$;

-- The ids that committed (derivd_commit_outcomes without the other outcomes).
CREATE OR REPLACE FUNCTION derivd_commit(jobs jsonb)
RETURNS SETOF bigint
LANGUAGE sql AS $$
    SELECT c.id FROM derivd_commit_outcomes(jobs) AS c WHERE c.outcome = 'committed'
$$;

-- The claim of up to `lim` rows (none when lim < 1), each with its own fresh token and
-- lease, and the file whose variants it makes (`file_id`: its own id, or rederive_of,
-- under whose prefix the worker stores them). Its caller decides durability (`claim` in
-- sql/queries.sql waits for no WAL flush; after a commit it is durable anyway).
-- `tenant_cap`: [queue] max_in_flight_per_tenant (0: none; derivd_pick_capped).
-- `prefix_format`: each claimed attempt's key prefix goes to the write-ahead registry in
-- the same transaction (derivd.storage.base.ATTEMPT_PREFIX_FORMAT, filled with the file
-- and the token), so that no round trip of its own comes before the PUTs; NULL: none (a
-- backend that stores no objects, noop, pays no statement for it).
--
-- Claim order: expired leases under the attempt cap (the one statement that knows the
-- rule); then due queued rows by priority DESC, fair_rank, id; every 20th call
-- (derivd_claim_turns) by available_at, id instead. A queued row whose attempts are used
-- up (max_attempts lowered since it was queued) is rejected `attempts_exhausted` when the
-- claim reaches it, as its expired lease would be: no claim takes a row past the cap.
CREATE OR REPLACE FUNCTION derivd_claim(lim integer, lease_s float8, max_attempts integer,
                                        host text, tenant_cap integer, prefix_format text)
RETURNS TABLE (id bigint, lease_token uuid, attempts integer, original_key text,
               original_version text, wait_s float8, tier integer,
               claimable_since timestamptz, file_id bigint)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
DECLARE
    oldest boolean;
    wanted integer;
    ids bigint[];
    since timestamptz[];
    tiers integer[];
    got_ids bigint[];
    got_since timestamptz[];
    got_attempts integer[];
    turn bigint;
    got integer;
    steady boolean;
    first integer;
    used_up boolean;
BEGIN
    IF lim < 1 THEN
        RETURN;
    END IF;
    turn := nextval('derivd_claim_turns');
    oldest := turn % 20 = 0;
    IF turn % 40 = 0 THEN
        -- Every other oldest-first turn serves the re-derivations first: they come after
        -- every due file otherwise, and a backfill under a steady load of uploads still
        -- gets 1 claim in 40 (derivd_claim_rederivations).
        RETURN QUERY
        SELECT r.id, r.lease_token, r.attempts, r.original_key, r.original_version,
               r.wait_s, r.tier, r.claimable_since, r.file_id
          FROM derivd_claim_rederivations(lim, lease_s, max_attempts, host,
                                          prefix_format) AS r;
        GET DIAGNOSTICS got = ROW_COUNT;
        lim := lim - got;
        IF lim < 1 THEN
            RETURN;
        END IF;
    END IF;
    steady := tenant_cap < 1 AND NOT oldest;
    -- One statement picks and locks the rows: expired leases first, whatever the turn or
    -- the cap (the one statement that knows the rule; a reclaimed row's tenant has it in
    -- flight already, so it adds nothing to the tenant's count), then, in the steady
    -- state (no cap, a ranked turn), due queued rows by priority DESC, fair_rank, id. The
    -- second branch is read only for what the first leaves of the limit, and not at all
    -- (LIMIT 0) on the other turns, whose queued rows are picked below.
    SELECT array_agg(c.id), array_agg(c.since), array_agg(c.tier), array_agg(c.n)
      INTO ids, since, tiers, got_attempts
      FROM (SELECT * FROM (SELECT f.id, f.lease_until AS since, 0 AS tier, f.attempts AS n
                             FROM archive_files AS f
                            WHERE f.status = 'processing' AND f.lease_until < now()
                              AND f.attempts < derivd_claim.max_attempts
                            ORDER BY f.lease_until
                            LIMIT lim
                              FOR UPDATE SKIP LOCKED) AS expired
            UNION ALL
            SELECT * FROM (SELECT f.id, f.available_at, 1, f.attempts
                             FROM archive_files AS f
                            WHERE f.status = 'queued' AND f.available_at <= now()
                            ORDER BY f.priority DESC, f.fair_rank, f.id
                            LIMIT CASE WHEN steady THEN lim ELSE 0 END
                              FOR UPDATE SKIP LOCKED) AS ranked
            LIMIT lim) AS c;
    IF NOT (steady AND derivd_claim.max_attempts > ALL (coalesce(got_attempts, '{}'))) THEN
        -- Another turn, or a queued row whose attempts are used up: the expired rows
        -- stay; queued rows, these and the next ones, go through the check below.
        first := array_position(tiers, 1);
        IF first IS NOT NULL THEN
            got_ids := ids[first:];
            got_since := since[first:];
            got_attempts := got_attempts[first:];
            ids := ids[:first - 1];
            since := since[:first - 1];
            tiers := tiers[:first - 1];
        ELSE
            got_ids := NULL;
        END IF;
        LOOP
            IF got_ids IS NULL THEN
                wanted := lim - coalesce(cardinality(ids), 0);
                EXIT WHEN wanted < 1;
                -- (One statement per order rather than one with its order switched by
                -- a parameter: each is a plain ordered scan of its partial index.)
                IF tenant_cap > 0 THEN
                    SELECT array_agg(p.id), array_agg(p.since), array_agg(p.attempts)
                      INTO got_ids, got_since, got_attempts
                      FROM derivd_pick_capped(wanted, tenant_cap, oldest) AS p;
                ELSIF oldest THEN
                    SELECT array_agg(q.id), array_agg(q.available_at), array_agg(q.attempts)
                      INTO got_ids, got_since, got_attempts
                      FROM (SELECT f.id, f.available_at, f.attempts
                              FROM archive_files AS f
                             WHERE f.status = 'queued' AND f.available_at <= now()
                             ORDER BY f.available_at, f.id
                             LIMIT wanted
                               FOR UPDATE SKIP LOCKED) AS q;
                ELSE
                    SELECT array_agg(q.id), array_agg(q.available_at), array_agg(q.attempts)
                      INTO got_ids, got_since, got_attempts
                      FROM (SELECT f.id, f.available_at, f.attempts
                              FROM archive_files AS f
                             WHERE f.status = 'queued' AND f.available_at <= now()
                             ORDER BY f.priority DESC, f.fair_rank, f.id
                             LIMIT wanted
                               FOR UPDATE SKIP LOCKED) AS q;
                END IF;
                EXIT WHEN got_ids IS NULL;
            END IF;
            used_up := NOT derivd_claim.max_attempts > ALL (got_attempts);
            IF used_up THEN
                -- max_attempts lowered since these were queued: rejected here, as an
                -- expired lease past the cap is, and the claim goes on.
                WITH done AS (
                    UPDATE archive_files AS f
                       SET status = 'rejected',
                           error_code = 'attempts_exhausted',
                           finished_at = now(),
                           updated_at = now()
                      FROM unnest(got_ids, got_attempts) AS g(got_id, n)
                     WHERE f.id = g.got_id AND g.n >= derivd_claim.max_attempts
                    RETURNING f.id, f.attempts)
                INSERT INTO archive_events (file_id, kind, attempt, error_code)
                SELECT d.id, 'exhausted', d.attempts, 'attempts_exhausted' FROM done AS d;
            END IF;
            SELECT ids || array_agg(g.got_id), since || array_agg(g.got_since),
                   tiers || array_agg(1)
              INTO ids, since, tiers
              FROM unnest(got_ids, got_since, got_attempts) AS g(got_id, got_since, n)
             WHERE g.n < derivd_claim.max_attempts;
            got_ids := NULL;
            EXIT WHEN NOT used_up;  -- all it asked for, or all there was
        END LOOP;
    END IF;
    IF ids IS NOT NULL THEN
        RETURN QUERY
        UPDATE archive_files AS f
           SET status = 'processing',
               lease_token = gen_random_uuid(),
               lease_until = now() + make_interval(secs => derivd_claim.lease_s),
               attempts = f.attempts + 1,
               claimed_at = now(),
               claimed_by = derivd_claim.host,
               updated_at = now()
          FROM unnest(ids, since, tiers) AS c(id, since, tier)
         WHERE f.id = c.id
        RETURNING f.id, f.lease_token, f.attempts, f.original_key, f.original_version,
                  extract(epoch FROM now() - c.since)::float8, c.tier, c.since, f.id;
        IF prefix_format IS NOT NULL THEN
            -- Each row the UPDATE above leased, with its new token, read back by primary
            -- key: an INSERT in the UPDATE's own statement (a data-modifying CTE) would be
            -- prepared for every claim, noop's too, where this IF costs noop one test.
            INSERT INTO pending_objects (key, file_id, lease_token)
            SELECT format(prefix_format, f.id, f.lease_token), f.id, f.lease_token
              FROM archive_files AS f
             WHERE f.id = ANY (ids)
            ON CONFLICT (key) DO NOTHING;
        END IF;
    END IF;
    -- What the files leave of the limit goes to re-derivations. (A claim that found its
    -- rows, the steady state, stops at this comparison.)
    IF coalesce(cardinality(ids), 0) < lim THEN
        RETURN QUERY
        SELECT r.id, r.lease_token, r.attempts, r.original_key, r.original_version,
               r.wait_s, r.tier, r.claimable_since, r.file_id
          FROM derivd_claim_rederivations(lim - coalesce(cardinality(ids), 0), lease_s,
                                          max_attempts, host, prefix_format) AS r;
    END IF;
    -- Under a tenant cap each claim records itself, with its row's tenant (migration
    -- 0015): the history in which a checker sees every tenant's rows in flight at every
    -- claim (harness.invariants). The event's id is drawn here, after this claim's
    -- tenant locks and counts, so id order is the order in which claims counted. The
    -- default claim records nothing (its cost per job is a measured budget). A
    -- re-derivation is outside the cap (docs/traffic.md): it records nothing either.
    IF tenant_cap > 0 THEN
        INSERT INTO archive_events (file_id, kind, attempt, lease_token, tenant)
        SELECT f.id, 'claimed', f.attempts, f.lease_token, f.tenant
          FROM archive_files AS f
         WHERE f.id = ANY (ids);
    END IF;
END $$;

-- The commit and then the claim in one call and one durable transaction, for hosts of the
-- releases before this one (their `commit_and_claim` calls it). This release's
-- statement of that name in sql/queries.sql composes the same two calls in its own
-- query, without this function's layer (one function scan, two RETURN QUERY and their
-- tuplestores: ~2 % of a noop job's server instructions, bench/RESULTS.md). Rows: kind =
-- 'committed' or 'rejected' (id only: derivd_commit_outcomes) or 'claimed' (the claim's
-- columns). The claim comes second and sees the commit: a committed row is no longer
-- claimable, a committed tenant's row no longer counts against its cap.
CREATE OR REPLACE FUNCTION derivd_commit_and_claim(jobs jsonb, lim integer, lease_s float8,
                                                   max_attempts integer, host text,
                                                   tenant_cap integer)
RETURNS TABLE (kind text, id bigint, lease_token uuid, attempts integer,
               original_key text, original_version text, wait_s float8, tier integer,
               claimable_since timestamptz, file_id bigint)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
    SELECT c.outcome, c.id, NULL::uuid, NULL::integer, NULL::text, NULL::text,
           NULL::float8, NULL::integer, NULL::timestamptz, NULL::bigint
      FROM derivd_commit_outcomes(jobs) AS c
     WHERE c.outcome <> 'lost';
    RETURN QUERY
    SELECT 'claimed'::text, c.*
      FROM derivd_claim(lim, lease_s, max_attempts, host, tenant_cap, NULL) AS c;
END $$;

-- The contracts of 0008/0010, for hosts on the previous release: no cap, no file id.
CREATE OR REPLACE FUNCTION derivd_commit_and_claim(jobs jsonb, lim integer, lease_s float8,
                                                   max_attempts integer, host text)
RETURNS TABLE (kind text, id bigint, lease_token uuid, attempts integer,
               original_key text, original_version text, wait_s float8, tier integer,
               claimable_since timestamptz)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
    SELECT c.kind, c.id, c.lease_token, c.attempts, c.original_key, c.original_version,
           c.wait_s, c.tier, c.claimable_since
      FROM derivd_commit_and_claim(jobs, lim, lease_s, max_attempts, host, 0) AS c;
END $$;

CREATE OR REPLACE FUNCTION derivd_claim(lim integer, lease_s float8, max_attempts integer,
                                        host text)
RETURNS TABLE (id bigint, lease_token uuid, attempts integer, original_key text,
               original_version text, wait_s float8, tier integer,
               claimable_since timestamptz)
LANGUAGE sql AS $$
    SELECT c.id, c.lease_token, c.attempts, c.original_key, c.original_version, c.wait_s,
           c.tier, c.claimable_since
      FROM derivd_claim(lim, lease_s, max_attempts, host, 0, NULL) AS c
$$;

-- The claim of the releases between 0014 and this one: their statements register the
-- write-ahead prefixes themselves.
CREATE OR REPLACE FUNCTION derivd_claim(lim integer, lease_s float8, max_attempts integer,
                                        host text, tenant_cap integer)
RETURNS TABLE (id bigint, lease_token uuid, attempts integer, original_key text,
               original_version text, wait_s float8, tier integer,
               claimable_since timestamptz, file_id bigint)
LANGUAGE sql AS $$
    SELECT * FROM derivd_claim(lim, lease_s, max_attempts, host, tenant_cap, NULL)
$$;

-- The fenced failure. retry: back to `queued` after delay_s unless the attempts are used
-- up; not retry (content errors): `rejected` at once. `code` is the final error code if
-- the row is rejected now; `extra_event` (e.g. 'timeout') is appended too. Returns the
-- new status, or no row when the fence failed (a `lease_lost` event is appended instead).
-- An id no file holds under that token may be a re-derivation's (one id space):
-- derivd_fail_rederivation; a file pays nothing for that but on a failed fence.
CREATE OR REPLACE FUNCTION derivd_fail(file_id bigint, token uuid, attempt integer,
                                       retry boolean, code text, max_attempts integer,
                                       delay_s float8, extra_event text)
RETURNS TABLE (status text, error_code text)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
DECLARE
    again boolean;
    n integer;
    new_status text;
    new_code text;
BEGIN
    UPDATE archive_files AS f
       SET status = CASE WHEN retry AND f.attempts < derivd_fail.max_attempts
                         THEN 'queued' ELSE 'rejected' END,
           error_code = CASE WHEN retry AND f.attempts < derivd_fail.max_attempts
                             THEN NULL ELSE code END,
           available_at = CASE WHEN retry AND f.attempts < derivd_fail.max_attempts
                               THEN now() + make_interval(secs => delay_s)
                               ELSE f.available_at END,
           finished_at = CASE WHEN retry AND f.attempts < derivd_fail.max_attempts
                              THEN NULL ELSE now() END,
           lease_token = NULL,
           lease_until = NULL,
           updated_at = now()
     WHERE f.id = derivd_fail.file_id AND f.lease_token = token  -- the fence
    RETURNING f.attempts, f.status, f.error_code INTO n, new_status, new_code;
    IF NOT FOUND THEN
        RETURN QUERY SELECT * FROM derivd_fail_rederivation(derivd_fail.file_id, token,
                                                            derivd_fail.attempt, retry, code,
                                                            derivd_fail.max_attempts,
                                                            delay_s, extra_event);
        RETURN;
    END IF;
    again := new_status = 'queued';
    INSERT INTO archive_events (file_id, kind, attempt, lease_token, error_code)
    VALUES (derivd_fail.file_id, CASE WHEN again THEN 'retry' ELSE 'rejected' END, n, token,
            coalesce(new_code, code));
    IF extra_event IS NOT NULL THEN
        INSERT INTO archive_events (file_id, kind, attempt, lease_token, error_code)
        VALUES (derivd_fail.file_id, extra_event, n, token, code);
    END IF;
    IF NOT again THEN
        PERFORM derivd_outbox_many(ARRAY[derivd_fail.file_id], 'file.rejected');
    END IF;
    status := new_status;
    error_code := new_code;
    RETURN NEXT;
END $$;

-- derivd_fail of a re-derivation (derivd_rederivations), the same fence and rules. A
-- rejection is the job's, never its file's: the file keeps its set and gets a
-- `rederive_rejected` event (not `rejected`: the rejected share counts files); the
-- attempt's other events carry the job's id. `ended_token` records that this attempt
-- ended the lease itself (the heartbeat's proof: derivd_heartbeat).
CREATE OR REPLACE FUNCTION derivd_fail_rederivation(job_id bigint, token uuid,
                                                    attempt integer, retry boolean,
                                                    code text, max_attempts integer,
                                                    delay_s float8, extra_event text)
RETURNS TABLE (status text, error_code text)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
DECLARE
    n integer;
    target bigint;
    new_status text;
    new_code text;
BEGIN
    UPDATE derivd_rederivations AS q
       SET status = CASE WHEN retry AND q.attempts < derivd_fail_rederivation.max_attempts
                         THEN 'queued' ELSE 'rejected' END,
           error_code = CASE WHEN retry AND q.attempts < derivd_fail_rederivation.max_attempts
                             THEN NULL ELSE code END,
           available_at = CASE WHEN retry AND q.attempts < derivd_fail_rederivation.max_attempts
                               THEN now() + make_interval(secs => delay_s)
                               ELSE q.available_at END,
           finished_at = CASE WHEN retry AND q.attempts < derivd_fail_rederivation.max_attempts
                              THEN NULL ELSE now() END,
           lease_token = NULL,
           lease_until = NULL,
           ended_token = token,
           updated_at = now()
     WHERE q.id = job_id AND q.lease_token = token  -- the fence
    RETURNING q.attempts, q.status, q.error_code, q.file_id
         INTO n, new_status, new_code, target;
    IF NOT FOUND THEN
        INSERT INTO archive_events (file_id, kind, attempt, lease_token)
        VALUES (job_id, 'lease_lost', derivd_fail_rederivation.attempt, token);
        RETURN;
    END IF;
    IF new_status = 'queued' THEN
        INSERT INTO archive_events (file_id, kind, attempt, lease_token, error_code)
        VALUES (job_id, 'retry', n, token, code);
    ELSE
        INSERT INTO archive_events (file_id, kind, attempt, lease_token, error_code)
        VALUES (target, 'rederive_rejected', n, token, new_code);
    END IF;
    IF extra_event IS NOT NULL THEN
        INSERT INTO archive_events (file_id, kind, attempt, lease_token, error_code)
        VALUES (job_id, extra_event, n, token, code);
    END IF;
    status := new_status;
    error_code := new_code;
    RETURN NEXT;
END $$;

-- A worker died holding this attempt (its supervisor reaped it: a crash, kill -9, the OOM
-- killer): a `worker_died` event on the attempt, then derivd_fail's retry rule with the
-- attempt counted: back to `queued` after delay_s while attempts remain, else `rejected`
-- attempts_exhausted. A crashed job waits for no lease (only a dead host's do). Fenced on
-- the token as derivd_fail is: no row when the attempt had moved on already (reclaimed,
-- committed, deleted; derivd_fail appends `lease_lost` then). The death is recorded
-- either way: it happened to that attempt.
CREATE OR REPLACE FUNCTION derivd_worker_died(file_id bigint, token uuid, attempt integer,
                                              max_attempts integer, delay_s float8)
RETURNS TABLE (status text, error_code text)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    INSERT INTO archive_events (file_id, kind, attempt, lease_token)
    VALUES (derivd_worker_died.file_id, 'worker_died', derivd_worker_died.attempt, token);
    RETURN QUERY
        SELECT d.status, d.error_code
          FROM derivd_fail(derivd_worker_died.file_id, token, derivd_worker_died.attempt,
                           true, 'attempts_exhausted', max_attempts, delay_s, NULL) AS d;
END $$;

-- Give a job back (shutdown, or too little lease left) without burning its attempt;
-- fenced, a failed fence appends `lease_lost`. Returns whether it was released. A
-- re-derivation's the same way (its own table; after the files' fence failed).
CREATE OR REPLACE FUNCTION derivd_release(file_id bigint, token uuid, attempt integer)
RETURNS boolean
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
DECLARE
    n integer;
BEGIN
    UPDATE archive_files AS f
       SET status = 'queued',
           attempts = greatest(f.attempts - 1, 0),
           available_at = now(),
           lease_token = NULL,
           lease_until = NULL,
           updated_at = now()
     WHERE f.id = derivd_release.file_id AND f.lease_token = token  -- the fence
    RETURNING f.attempts INTO n;
    IF NOT FOUND THEN
        UPDATE derivd_rederivations AS q
           SET status = 'queued',
               attempts = greatest(q.attempts - 1, 0),
               available_at = now(),
               lease_token = NULL,
               lease_until = NULL,
               ended_token = token,
               updated_at = now()
         WHERE q.id = derivd_release.file_id AND q.lease_token = token  -- the fence
        RETURNING q.attempts INTO n;
    END IF;
    IF n IS NULL THEN
        INSERT INTO archive_events (file_id, kind, attempt, lease_token)
        VALUES (derivd_release.file_id, 'lease_lost', derivd_release.attempt, token);
        RETURN false;
    END IF;
    INSERT INTO archive_events (file_id, kind, attempt, lease_token)
    VALUES (derivd_release.file_id, 'released', n + 1, token);
    RETURN true;
END $$;

-- == Re-derivations (backfill; docs/traffic.md) =========================================

-- Claim up to `lim` re-derivations: expired leases under the attempt cap first, then
-- due ones by priority and id. The claim calls it for what the files leave of its limit
-- (re-derivations come after every due file, whatever its priority: a file without
-- variants waits less than a file whose old ones are readable) and, on its share of the
-- oldest-first turns, before them (the starvation bound).
-- `prefix_format` as in derivd_claim: the key prefix is the file's (where the variants
-- go), the registry row the job's.
-- (Its signature before `prefix_format`, called by derivd_claim alone, is gone.)
DROP FUNCTION IF EXISTS derivd_claim_rederivations(integer, float8, integer, text);
CREATE OR REPLACE FUNCTION derivd_claim_rederivations(lim integer, lease_s float8,
                                                      max_attempts integer, host text,
                                                      prefix_format text)
RETURNS TABLE (kind text, id bigint, lease_token uuid, attempts integer,
               original_key text, original_version text, wait_s float8, tier integer,
               claimable_since timestamptz, file_id bigint)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
DECLARE
    ids bigint[];
    since timestamptz[];
    tiers integer[];
    counts integer[];
BEGIN
    SELECT array_agg(c.id), array_agg(c.since), array_agg(c.tier), array_agg(c.n)
      INTO ids, since, tiers, counts
      FROM (SELECT * FROM (SELECT q.id, q.lease_until AS since, 0 AS tier, q.attempts AS n
                             FROM derivd_rederivations AS q
                            WHERE q.status = 'processing' AND q.lease_until < now()
                              AND q.attempts < derivd_claim_rederivations.max_attempts
                            ORDER BY q.lease_until
                            LIMIT lim
                              FOR UPDATE SKIP LOCKED) AS expired
            UNION ALL
            SELECT * FROM (SELECT q.id, q.available_at, 2, q.attempts
                             FROM derivd_rederivations AS q
                            WHERE q.status = 'queued' AND q.available_at <= now()
                            ORDER BY q.priority DESC, q.id
                            LIMIT lim
                              FOR UPDATE SKIP LOCKED) AS due
            LIMIT lim) AS c;
    IF ids IS NULL THEN
        RETURN;
    END IF;
    IF NOT derivd_claim_rederivations.max_attempts > ALL (counts) THEN
        -- Queued jobs whose attempts are used up (max_attempts lowered since they were
        -- queued) are rejected here, as the file claim does (derivd_claim): the job's
        -- rejection, never its file's (`rederive_rejected` on the file). This claim
        -- returns the others; the next one looks further.
        WITH done AS (
            UPDATE derivd_rederivations AS q
               SET status = 'rejected', error_code = 'attempts_exhausted',
                   finished_at = now(), updated_at = now()
              FROM unnest(ids, counts) AS g(got_id, n)
             WHERE q.id = g.got_id AND g.n >= derivd_claim_rederivations.max_attempts
            RETURNING q.file_id, q.attempts)
        INSERT INTO archive_events (file_id, kind, attempt, error_code)
        SELECT d.file_id, 'rederive_rejected', d.attempts, 'attempts_exhausted'
          FROM done AS d;
    END IF;
    RETURN QUERY
    UPDATE derivd_rederivations AS q
       SET status = 'processing',
           lease_token = gen_random_uuid(),
           lease_until = now() + make_interval(secs => lease_s),
           attempts = q.attempts + 1,
           ended_token = NULL,
           claimed_at = now(),
           claimed_by = host,
           updated_at = now()
      FROM unnest(ids, since, tiers, counts) AS c(id, since, tier, n)
     WHERE q.id = c.id AND c.n < derivd_claim_rederivations.max_attempts
    RETURNING 'claimed'::text, q.id, q.lease_token, q.attempts, q.original_key,
              q.original_version, extract(epoch FROM now() - c.since)::float8, c.tier,
              c.since, q.file_id;
    IF prefix_format IS NOT NULL THEN
        -- The jobs the UPDATE above leased (those it rejected are `rejected` now), read
        -- back as the files' claim does (derivd_claim says why).
        INSERT INTO pending_objects (key, file_id, lease_token)
        SELECT format(prefix_format, q.file_id, q.lease_token), q.id, q.lease_token
          FROM derivd_rederivations AS q
         WHERE q.id = ANY (ids) AND q.status = 'processing'
        ON CONFLICT (key) DO NOTHING;
    END IF;
END $$;

-- The fenced commit of a re-derivation (`job`: one element of the commit's `jobs`), for
-- an id the files' fence did not find. The job row (fenced: id + token) and then the
-- file are locked (`derivd delete` locks in the same order). Returns:
-- - 'committed': the file, still `ready`, had exactly its run's configured set swapped
--   in (the old objects to derivd_retired_objects for the sweep after delete_guard), its
--   derived_* updated, a `rederived` event appended; the job row is gone.
-- - 'rejected': the set is not the run's configured one (slot -> fingerprint; a set
--   of none is never one): the job is rejected `processing_failed` (a backend fault:
--   noop, a plugin that returns fewer variants, a worker on another configuration), the
--   file keeps its set and gets `rederive_rejected`; the objects go to the orphan sweep.
-- - 'lost': the lease is gone, or the file is no longer ready (deleted meanwhile; the
--   job row goes): a `lease_lost` event on the job, the objects to the orphan sweep.
CREATE OR REPLACE FUNCTION derivd_commit_rederivation(job jsonb)
RETURNS text
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
DECLARE
    j record;
    target bigint;
    n integer;
    run bigint;
    wanted jsonb;
    made jsonb;
    slots integer;
BEGIN
    SELECT * INTO j
      FROM jsonb_to_record(job)
           AS x(id bigint, token uuid, attempt integer, derived_key text,
                derived_version text, sha256 text, width integer, height integer,
                variants jsonb);
    SELECT q.file_id, q.attempts, q.backfill INTO target, n, run
      FROM derivd_rederivations AS q
     WHERE q.id = j.id AND q.lease_token = j.token  -- the fence
       FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO archive_events (file_id, kind, attempt, lease_token)
        VALUES (j.id, 'lease_lost', j.attempt, j.token);
        RETURN 'lost';
    END IF;
    PERFORM 1 FROM archive_files AS t WHERE t.id = target AND t.status = 'ready' FOR UPDATE;
    IF NOT FOUND THEN
        DELETE FROM derivd_rederivations AS q WHERE q.id = j.id;
        INSERT INTO archive_events (file_id, kind, attempt, lease_token)
        VALUES (j.id, 'lease_lost', n, j.token);
        RETURN 'lost';
    END IF;
    SELECT coalesce(jsonb_object_agg(v.name || '.' || v.format, v.fingerprint), '{}'),
           count(*)
      INTO made, slots
      FROM jsonb_to_recordset(coalesce(j.variants, '[]'))
           AS v(name text, format text, fingerprint text);
    SELECT b.configured INTO wanted FROM derivd_backfills AS b WHERE b.id = run;
    IF slots = 0 OR slots <> (SELECT count(*) FROM jsonb_object_keys(made))
       OR (wanted IS NOT NULL AND made <> wanted) THEN
        UPDATE derivd_rederivations AS q
           SET status = 'rejected', error_code = 'processing_failed', lease_token = NULL,
               lease_until = NULL, ended_token = j.token, finished_at = now(),
               updated_at = now()
         WHERE q.id = j.id;
        INSERT INTO archive_events (file_id, kind, attempt, lease_token, error_code)
        VALUES (target, 'rederive_rejected', n, j.token, 'processing_failed');
        RETURN 'rejected';
    END IF;
    DELETE FROM derivd_rederivations AS q WHERE q.id = j.id;
    INSERT INTO derivd_retired_objects (key, file_id)
    SELECT a.key, a.file_id FROM archive_variants AS a WHERE a.file_id = target
    ON CONFLICT (key) DO NOTHING;
    DELETE FROM archive_variants AS a WHERE a.file_id = target;
    INSERT INTO archive_variants (file_id, name, format, content_type, key, version, sha256,
                                  width, height, lease_token, fingerprint, bytes)
    SELECT target, v.name, v.format, v.content_type, v.key, v.version, v.sha256, v.width,
           v.height, j.token, v.fingerprint, v.bytes
      FROM jsonb_to_recordset(j.variants)
           AS v(name text, format text, content_type text, key text, version text,
                sha256 text, width integer, height integer, fingerprint text,
                bytes bigint);
    UPDATE archive_files AS f
       SET derived_key = j.derived_key,
           derived_version = j.derived_version,
           sha256 = j.sha256,
           width = j.width,
           height = j.height,
           updated_at = now()
     WHERE f.id = target;
    INSERT INTO archive_events (file_id, kind, attempt, lease_token)
    VALUES (target, 'rederived', n, j.token);
    DELETE FROM pending_objects AS p WHERE p.lease_token = j.token;
    PERFORM derivd_outbox_many(ARRAY[target], 'file.rederived');
    RETURN 'committed';
END $$;

-- == The fleet ==========================================================================

-- The staleness rule of the host registry: a host is stale once three of its own
-- heartbeat intervals pass without one. One late or lost heartbeat is no reason to call
-- a host dead, and with the heartbeat at most a third of the lease ([queue] heartbeat) a
-- host is called stale no later than its leases expire. `derivd status` shows stale
-- hosts; the supervisors' stats round prunes them after [sweep] orphan_guard. LANGUAGE
-- sql and STABLE, so the server inlines it into the calling query (now() is that
-- statement's time).
CREATE OR REPLACE FUNCTION derivd_host_stale(last_heartbeat timestamptz, heartbeat_s float8)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT last_heartbeat < now() - make_interval(secs => 3 * heartbeat_s)
$$;

-- The heartbeat: one call per host every [queue] heartbeat (derivd.queue.db). `jobs`: a
-- JSON array of {id, token, file} for every job this host holds (running and
-- claimed-unstarted; `file`: the file a re-derivation serves, absent for a file's own
-- job). Returns the ids whose lease still holds, fenced by id + token (with `renew`,
-- exactly those leases are extended to now() + lease_s), and the ids whose attempt has
-- just ended itself; every other id sent is lost. The host's registry row is refreshed
-- (created if pruned), fenced on the run that owns it: with `started_at` (from
-- register_host, which starts a run's row) only the row of this pid and start.
-- Database time throughout.
--
-- "Ended itself": a worker's fenced commit (or failure, or release) can land between
-- the supervisor's last reading of its reports and this call; killing the worker for it
-- would kill a healthy worker. That check is a statement of its own, after the lease
-- statements, so that it sees a commit they waited for: a renewal that finds the row
-- locked by the job's own commit waits for it, then finds the token gone (the
-- renewal's snapshot was taken before the commit, which one statement could never see).
-- The proof of an attempt's own end is, for a file, its event at the row's last change
-- (same transaction time: updated_at = at = now(), carrying the attempt's token; a row
-- moved on since has none); for a re-derivation whose row is still there, its
-- ended_token; for one that committed (its row is gone), the `rederived` event on its
-- file at the file's last change.
CREATE OR REPLACE FUNCTION derivd_heartbeat(jobs jsonb, renew boolean, lease_s float8,
                                            host text, pid integer, version text,
                                            backend text, workers integer, busy integer,
                                            heartbeat_s float8, started_at timestamptz)
RETURNS SETOF bigint
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
DECLARE
    ids bigint[] := ARRAY(SELECT (e ->> 'id')::bigint FROM jsonb_array_elements(jobs) AS e);
    alive bigint[];
    more bigint[];
BEGIN
    -- Fenced on the run that owns the row (pid + start, from register_host): a run
    -- whose row another run took over (it went stale meanwhile) never writes it again.
    -- Without a start (tests, benchmarks) the row is this call's.
    INSERT INTO derivd_hosts AS r
           (host, pid, version, backend, workers, busy, heartbeat_s, started_at)
    VALUES (derivd_heartbeat.host, derivd_heartbeat.pid, derivd_heartbeat.version,
            derivd_heartbeat.backend, derivd_heartbeat.workers, derivd_heartbeat.busy,
            derivd_heartbeat.heartbeat_s, coalesce(derivd_heartbeat.started_at, now()))
    ON CONFLICT (host) DO UPDATE
       SET pid = EXCLUDED.pid, version = EXCLUDED.version, backend = EXCLUDED.backend,
           workers = EXCLUDED.workers, busy = EXCLUDED.busy,
           heartbeat_s = EXCLUDED.heartbeat_s, last_heartbeat = now()
     WHERE derivd_heartbeat.started_at IS NULL
        OR (r.pid = EXCLUDED.pid AND r.started_at = derivd_heartbeat.started_at);
    IF cardinality(ids) = 0 THEN
        RETURN;
    END IF;
    IF renew THEN
        WITH held AS (SELECT * FROM jsonb_to_recordset(jobs) AS j(id bigint, token uuid)),
             renewed AS (
                 UPDATE archive_files AS f
                    SET lease_until = now() + make_interval(secs => lease_s)
                   FROM held AS h
                  WHERE f.id = h.id AND f.lease_token = h.token
                    AND f.id = ANY(ids)  -- by primary key (the JSON hides the row count)
                 RETURNING f.id)
        SELECT array_agg(r.id) INTO alive FROM renewed AS r;
        WITH held AS (SELECT * FROM jsonb_to_recordset(jobs) AS j(id bigint, token uuid)),
             renewed AS (
                 UPDATE derivd_rederivations AS q
                    SET lease_until = now() + make_interval(secs => lease_s)
                   FROM held AS h
                  WHERE q.id = h.id AND q.lease_token = h.token AND q.id = ANY(ids)
                 RETURNING q.id)
        SELECT array_agg(r.id) INTO more FROM renewed AS r;
    ELSE
        SELECT array_agg(f.id) INTO alive
          FROM archive_files AS f
          JOIN jsonb_to_recordset(jobs) AS h(id bigint, token uuid)
            ON f.id = h.id AND f.lease_token = h.token
         WHERE f.id = ANY(ids);
        SELECT array_agg(q.id) INTO more
          FROM derivd_rederivations AS q
          JOIN jsonb_to_recordset(jobs) AS h(id bigint, token uuid)
            ON q.id = h.id AND q.lease_token = h.token
         WHERE q.id = ANY(ids);
    END IF;
    alive := coalesce(alive, '{}') || coalesce(more, '{}');
    RETURN QUERY SELECT unnest(alive);
    IF cardinality(alive) = cardinality(ids) THEN
        RETURN;  -- every lease holds: the usual heartbeat ends here
    END IF;
    -- Evaluated only for held ids whose lease did not hold, i.e. almost never; `at =`
    -- prunes the event partitions to one, OFFSET 0 keeps each a lookup per row.
    RETURN QUERY
    SELECT h.id
      FROM jsonb_to_recordset(jobs) AS h(id bigint, token uuid, file bigint)
     WHERE NOT h.id = ANY(alive)
       AND (EXISTS (SELECT 1 FROM archive_files AS f
                     WHERE f.id = h.id AND f.status IN ('ready', 'queued', 'rejected')
                       AND EXISTS (SELECT 1 FROM archive_events AS e
                                    WHERE e.at = f.updated_at AND e.file_id = f.id
                                      AND e.lease_token = h.token
                                      AND e.kind IN ('ready', 'retry', 'rejected',
                                                     'released')
                                   OFFSET 0))
            OR EXISTS (SELECT 1 FROM derivd_rederivations AS q
                        WHERE q.id = h.id AND q.ended_token = h.token)
            OR EXISTS (SELECT 1 FROM archive_files AS t
                        WHERE t.id = h.file
                          AND NOT EXISTS (SELECT 1 FROM derivd_rederivations AS q
                                           WHERE q.id = h.id)
                          AND EXISTS (SELECT 1 FROM archive_events AS e
                                       WHERE e.at = t.updated_at AND e.file_id = t.id
                                         AND e.lease_token = h.token
                                         AND e.kind = 'rederived'
                                      OFFSET 0)));
END $$;

-- == Queue health and the dashboard =====================================================

-- Queue health whose cost does not grow with history, cached for the fleet. A cached
-- result younger than max_age_s is returned as it is; otherwise the caller takes the
-- cache row's lock, and whoever waited for it finds the fresh result another host just
-- computed (one computation per interval for the whole fleet). Counts of the live states
-- are exact, from their partial indexes; the final states (ready, rejected, deleted) are
-- exact while the table is small (under 50,000 rows by the planner's statistics) and
-- planner estimates beyond (`estimated` lists which counts are). max_age_s = 0: compute
-- now.
-- Every answer carries `age_s`: how long ago the reading was computed (0: now), so that
-- whoever shows a shared reading can say how old it is.
CREATE OR REPLACE FUNCTION derivd_queue_stats(max_age_s float8)
RETURNS jsonb
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    result jsonb;
    total float8;
    counts jsonb;
BEGIN
    SELECT s.payload || jsonb_build_object('age_s', extract(epoch FROM now() - s.computed_at)::float8)
      INTO result
      FROM derivd_stats_cache AS s
     WHERE s.name = 'queue' AND s.computed_at > now() - make_interval(secs => max_age_s);
    IF FOUND THEN
        RETURN result;
    END IF;
    SELECT s.payload || jsonb_build_object('age_s', extract(epoch FROM now() - s.computed_at)::float8)
      INTO result
      FROM derivd_stats_cache AS s
     WHERE s.name = 'queue'
       AND s.computed_at > now() - make_interval(secs => max_age_s)
       FOR UPDATE;
    IF FOUND THEN  -- computed by the host whose lock this one waited for
        RETURN result;
    END IF;
    -- The table's size by the planner's statistics, scaled to its size on disk now.
    SELECT c.reltuples * CASE WHEN c.relpages > 0
                              THEN pg_relation_size(c.oid)
                                   / current_setting('block_size')::float8 / c.relpages
                              ELSE 1 END
      INTO total
      FROM pg_class AS c WHERE c.oid = 'archive_files'::regclass;
    IF total < 50000 THEN
        -- LIMIT: bounded even if the statistics are far behind the table.
        SELECT coalesce(jsonb_object_agg(few.status, few.n), '{}') INTO counts
          FROM (SELECT a.status, count(*) AS n
                  FROM (SELECT f.status FROM archive_files AS f LIMIT 50000) AS a
                 GROUP BY a.status) AS few;
    ELSE
        SELECT coalesce(jsonb_object_agg(n.status, n.n) FILTER (WHERE n.n > 0), '{}') INTO counts
          FROM (SELECT 'pending' AS status,
                       (SELECT count(*) FROM archive_files WHERE status = 'pending') AS n
                UNION ALL SELECT 'queued',
                       (SELECT count(*) FROM archive_files WHERE status = 'queued')
                UNION ALL SELECT 'processing',
                       (SELECT count(*) FROM archive_files WHERE status = 'processing')
                UNION ALL SELECT 'deleting',
                       (SELECT count(*) FROM archive_files WHERE status = 'deleting')
                UNION ALL
                SELECT m.status, round(m.freq * total)::bigint
                  FROM pg_stats AS s,
                       unnest(s.most_common_vals::text::text[], s.most_common_freqs)
                           AS m(status, freq)
                 WHERE s.schemaname = current_schema() AND s.tablename = 'archive_files'
                   AND s.attname = 'status'
                   AND m.status IN ('ready', 'rejected', 'deleted')) AS n;
    END IF;
    result := jsonb_build_object(
        'counts', counts,
        'estimated', CASE WHEN total < 50000 THEN '[]'::jsonb
                     ELSE '["ready", "rejected", "deleted"]'::jsonb END,
        'oldest_claimable_age_s',
            (SELECT extract(epoch FROM now() - min(f.available_at))::float8
               FROM archive_files AS f
              WHERE f.status = 'queued' AND f.available_at <= now()),
        'expired_leases',
            (SELECT count(*) FROM archive_files AS f
              WHERE f.status = 'processing' AND f.lease_until < now()));
    UPDATE derivd_stats_cache AS s
       SET computed_at = now(), payload = result
     WHERE s.name = 'queue';
    RETURN result || '{"age_s": 0}';
END $$;

-- The recent-events counts behind `derivd status`, the dashboard and the metrics (events
-- per kind, and rejections per error code, over the last `window_s` seconds), cached for
-- the fleet like derivd_queue_stats: a result younger than max_age_s is returned
-- as it is; otherwise the caller takes the cache row's lock, and whoever waited for it
-- finds the result another host (or probe) just computed. One row per window. Every
-- caller used to count the window's events itself, in two statements: ~120 ms at 100
-- jobs/s with the default one-hour window, paid by each health probe (bench/RESULTS.md,
-- "derivd status as a health probe"). Now one scan per max_age_s for everyone.
CREATE OR REPLACE FUNCTION derivd_event_window(window_s float8, max_age_s float8)
RETURNS jsonb
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    key text := 'events ' || window_s::text;
    result jsonb;
BEGIN
    SELECT s.payload || jsonb_build_object('age_s', extract(epoch FROM now() - s.computed_at)::float8)
      INTO result
      FROM derivd_stats_cache AS s
     WHERE s.name = key AND s.computed_at > now() - make_interval(secs => max_age_s);
    IF FOUND THEN
        RETURN result;
    END IF;
    INSERT INTO derivd_stats_cache (name, computed_at, payload)
    VALUES (key, '-infinity', '{}')
    ON CONFLICT (name) DO NOTHING;
    SELECT s.payload || jsonb_build_object('age_s', extract(epoch FROM now() - s.computed_at)::float8)
      INTO result
      FROM derivd_stats_cache AS s
     WHERE s.name = key AND s.computed_at > now() - make_interval(secs => max_age_s)
       FOR UPDATE;
    IF FOUND THEN  -- computed by the caller whose lock this one waited for
        RETURN result;
    END IF;
    WITH counted AS (
        SELECT e.kind, e.error_code, count(*)::int AS n
          FROM archive_events AS e
         WHERE e.at >= now() - make_interval(secs => window_s)
         GROUP BY e.kind, e.error_code
    )
    SELECT jsonb_build_object(
               'events',
               (SELECT coalesce(jsonb_object_agg(k.kind, k.n), '{}')
                  FROM (SELECT c.kind, sum(c.n)::int AS n FROM counted AS c
                         GROUP BY c.kind) AS k),
               'rejected_by_code',
               (SELECT coalesce(jsonb_object_agg(r.code, r.n), '{}')
                  FROM (SELECT coalesce(c.error_code, 'none') AS code, sum(c.n)::int AS n
                          FROM counted AS c
                         WHERE c.kind IN ('rejected', 'exhausted')
                         GROUP BY 1) AS r))
      INTO result;
    UPDATE derivd_stats_cache AS s
       SET computed_at = now(), payload = result
     WHERE s.name = key;
    RETURN result || '{"age_s": 0}';
END $$;

-- The dashboard's chart, at a cost that does not grow with the table: jobs finished per
-- minute over the last hour counted from the events alone (capped at `cap` events), and
-- the median duration of each minute from at most `sample` of its latest ready/rejected
-- jobs, each looked up by primary key. (Joining every finishing event of the hour to its
-- row made the planner hash the whole table: 0.9 s at 1M rows.)
--
-- SET jit = off: the probes' estimated cost crosses jit_above_cost, and compiling this
-- one statement took longer (~0.7 s) than running it. A function's SET clause applies
-- while it is planned and run, through a pooler too (no session setting).
CREATE OR REPLACE FUNCTION derivd_finished_per_minute(cap integer, sample integer)
RETURNS TABLE (minutes_ago integer, finished integer, median_s float8)
LANGUAGE sql STABLE SET jit = off AS $$
WITH recent AS (
    SELECT e.file_id, e.at, e.kind,
           least(floor(date_part('epoch', now() - e.at) / 60), 59)::integer AS minute
      FROM archive_events AS e
     WHERE e.at >= now() - interval '1 hour' AND e.kind IN ('ready', 'rejected', 'exhausted')
     LIMIT cap
), counted AS (
    SELECT r.minute, count(*)::integer AS finished
      FROM recent AS r
     GROUP BY 1
), latest AS (
    -- exhausted rows have no meaningful duration (their last claim died)
    SELECT s.minute, s.file_id, s.at
      FROM (SELECT r.minute, r.file_id, r.at,
                   row_number() OVER (PARTITION BY r.minute ORDER BY r.at DESC) AS n
              FROM recent AS r
             WHERE r.kind <> 'exhausted') AS s
     WHERE s.n <= sample
), durations AS (
    -- claim to finish, from the row's last claim (LIMIT 1 keeps it a key lookup per job)
    SELECT l.minute,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY date_part('epoch', l.at - f.claimed_at))
               FILTER (WHERE f.claimed_at <= l.at) AS median_s
      FROM latest AS l
     CROSS JOIN LATERAL (SELECT a.claimed_at FROM archive_files AS a
                          WHERE a.id = l.file_id LIMIT 1) AS f
     GROUP BY 1
)
SELECT c.minute, c.finished, d.median_s::float8
  FROM counted AS c
  LEFT JOIN durations AS d ON d.minute = c.minute
 ORDER BY 1
$$;

-- == Near-duplicates (derivd.client.similar) ============================================

-- derivd.client.similar: the other ready files within `max_distance` bits of a file's
-- dhash, nearest first (then by id); none when the file has no dhash. `#` is XOR and
-- bit_count of the bigint as bit(64) counts the differing bits.
--
-- By default a (parallel) scan of the ready rows (bench/similar.py: ~0.6 s at 1M rows on
-- 2 cores). A deployment that asks often creates the optional index of the README,
-- archive_files_dhash_bands: a GIN index on the dhash's four 16-bit bands, each tagged
-- with its position (derivd_dhash_bands). Two hashes within 7 bits agree on some band to
-- within one bit (pigeonhole: 4 bands x 2 bits = 8), so the rows whose bands meet the
-- file's 68 probes (each band's value and its 16 one-bit neighbours: derivd_dhash_probes)
-- hold every answer up to 7 bits; the exact distance then filters them. It makes similar
-- ~50x faster at 1M rows and costs each analysed commit ~18 % more WAL, which is why no
-- migration creates it. Without the index the band filter is slower than the plain scan,
-- so derivd_similar probes only when the index exists.

-- Not STRICT: PostgreSQL then inlines it (no function call per row, and the index's
-- expression and the query's match).
CREATE OR REPLACE FUNCTION derivd_dhash_bands(h bigint) RETURNS integer[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT ARRAY[(h & 65535)::integer, (65536 | ((h >> 16) & 65535))::integer,
                 (131072 | ((h >> 32) & 65535))::integer,
                 (196608 | ((h >> 48) & 65535))::integer]
$$;

CREATE OR REPLACE FUNCTION derivd_dhash_probes(h bigint) RETURNS integer[]
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT array_agg(((b << 16) | (((h >> (16 * b)) & 65535) # m))::integer)
      FROM generate_series(0, 3) AS b,
           (SELECT 0 AS m UNION ALL SELECT 1 << k FROM generate_series(0, 15) AS k) AS flips
$$;

-- The band probe, serial: the planner expects thousands of rows where it reads a few
-- hundred, and plans parallel workers that take longer to start (~150 ms on 2 cores)
-- than the whole probe (~10 ms at 1M rows). The SET is this function's alone.
CREATE OR REPLACE FUNCTION derivd_similar_near(h bigint, file_id bigint, max_distance integer)
RETURNS SETOF bigint
LANGUAGE sql STABLE SET max_parallel_workers_per_gather = 0 AS $$
    SELECT f.id FROM archive_files AS f
     WHERE derivd_dhash_bands(f.original_dhash) && derivd_dhash_probes(h)
       AND f.original_dhash IS NOT NULL AND f.status = 'ready' AND f.id <> file_id
       AND bit_count((f.original_dhash # h)::bit(64)) <= max_distance
     ORDER BY bit_count((f.original_dhash # h)::bit(64)), f.id
$$;

-- At most `max_rows` answers (capped at 10,000 whatever is asked): at a wide distance
-- most of the table matches, and an unbounded answer is a whole table shipped to one app
-- process. A top-N sort keeps the scan's memory bounded too.
CREATE OR REPLACE FUNCTION derivd_similar(file_id bigint, max_distance integer, max_rows integer)
RETURNS SETOF bigint
LANGUAGE plpgsql STABLE AS $$
DECLARE
    h bigint;
    cap integer := LEAST(GREATEST(coalesce(max_rows, 0), 0), 10000);
BEGIN
    SELECT f.original_dhash INTO h FROM archive_files AS f WHERE f.id = file_id;
    IF h IS NULL OR cap = 0 THEN
        RETURN;
    END IF;
    IF max_distance <= 7 AND to_regclass('archive_files_dhash_bands') IS NOT NULL THEN
        RETURN QUERY
        SELECT n.id FROM derivd_similar_near(h, file_id, max_distance) AS n(id) LIMIT cap;
    ELSE
        RETURN QUERY
        SELECT f.id FROM archive_files AS f
         WHERE f.status = 'ready' AND f.id <> file_id
           AND bit_count((f.original_dhash # h)::bit(64)) <= max_distance
         ORDER BY bit_count((f.original_dhash # h)::bit(64)), f.id
         LIMIT cap;
    END IF;
END $$;

-- The two-argument form of earlier releases (and of the README's SQL): the 100 nearest.
CREATE OR REPLACE FUNCTION derivd_similar(file_id bigint, max_distance integer)
RETURNS SETOF bigint
LANGUAGE sql STABLE AS $$
    SELECT derivd_similar(file_id, max_distance, 100)
$$;

-- == Where the functions look ===========================================================

-- [database] schema (`derivd migrate` calls it after this file, only with a schema):
-- each function of `signatures` (this file's, as `name(types)`) looks its names up in
-- the schema it lives in, whoever calls it: an app's INSERT on a connection of its own
-- (search_path: public) fires the triggers and the row's rule, which must find derivd's
-- tables and functions.
CREATE OR REPLACE FUNCTION derivd_pin_search_path(signatures text[])
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    s text;
BEGIN
    FOREACH s IN ARRAY signatures LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I', to_regprocedure(s),
                       current_schema());
    END LOOP;
END $$;

-- == For upload APIs =====================================================================

-- Deletion (`derivd delete`, derivd.client.delete, any app's SQL): each live file among
-- `ids` moves to `deleting`, which revokes its lease: a running attempt can no longer
-- commit or fail the row. The files' re-derivations go too, live or rejected (their
-- attempts' commits then fail their fence; objects to the orphan sweep): deleted first,
-- so their rows are locked before the files' (`locked` waits for `revoked`: a
-- re-derivation's commit locks its job row, then the file, so this order cannot deadlock
-- with it). The sweep removes the objects after [sweep] delete_guard, then marks the
-- row `deleted` (and announces file.deleted). `actor` goes to the events. Returns the
-- ids it moved (not those already deleting or deleted, nor unknown ones).
CREATE OR REPLACE FUNCTION derivd_delete(ids bigint[], actor text)
RETURNS SETOF bigint
LANGUAGE sql AS $$
WITH revoked AS (
    DELETE FROM derivd_rederivations
     WHERE file_id = ANY(ids)
    RETURNING id
), locked AS (
    SELECT id
      FROM archive_files
     WHERE id = ANY(ids) AND status NOT IN ('deleting', 'deleted')
       AND (SELECT count(*) FROM revoked) >= 0  -- after `revoked`
     ORDER BY id
       FOR UPDATE
), done AS (
    UPDATE archive_files AS f
       SET status = 'deleting', lease_token = NULL, lease_until = NULL, updated_at = now(),
           error_code = NULL  -- a rejected file's code stays in its events
      FROM locked AS l
     WHERE f.id = l.id
    RETURNING f.id, f.attempts
), requested_event AS (
    INSERT INTO archive_events (file_id, kind, attempt, actor)
    SELECT id, 'delete_requested', attempts, actor FROM done
    RETURNING 1
)
SELECT id FROM done ORDER BY id;
$$;

-- One file, as an app deletes it: `SELECT derivd_delete_file($1)`. Returns the file's
-- status after the call: 'deleting' (now, or already) or 'deleted'; NULL when no file
-- has this id. `actor` (default 'app') goes to the events.
CREATE OR REPLACE FUNCTION derivd_delete_file(file_id bigint, actor text DEFAULT 'app')
RETURNS text
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    now_status text;
BEGIN
    PERFORM derivd_delete(ARRAY[derivd_delete_file.file_id], derivd_delete_file.actor);
    SELECT f.status INTO now_status FROM archive_files AS f
     WHERE f.id = derivd_delete_file.file_id;
    RETURN now_status;
END $$;
