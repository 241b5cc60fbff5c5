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

-- == The lease protocol =================================================================

-- The fenced commit of one or more finished attempts (`jobs`: a JSON array of {id,
-- token, attempt, derived_key, derived_version, sha256, width, height, variants,
-- original_width, original_height, original_format, original_frames, original_has_alpha,
-- original_colour, original_placeholder, original_dhash}; the analysis keys absent, as
-- from a handler that analyses nothing or a host of a release before 0013: NULLs). Each
-- row passes or fails its own fence. Its fenced UPDATE and its event (`ready`, or
-- `lease_lost` when the fence fails) are one statement; for a row that passes, its
-- variants are recorded and, when it stored some, its attempt's write-ahead entries
-- cleared (an attempt registers pending objects exactly for the variants it PUTs).
-- Returns the ids that committed. Durable: its caller leaves synchronous_commit alone.
--
-- Commit of a re-derivation (rederive_of set): under the file's row lock, while the file
-- is still `ready`, its variants are replaced by the new ones (the old objects go to
-- derivd_retired_objects), its derived_* updated and a `rederived` event appended to it;
-- the job row is then deleted (its attempt's `ready` event stays). A file no longer ready
-- (deleted meanwhile) keeps what it has: the job row is deleted with a `lease_lost`
-- event and its objects are left to the orphan sweep. Either way the job row's fence
-- (id + token) is checked first.
CREATE OR REPLACE FUNCTION derivd_commit(jobs jsonb)
RETURNS SETOF bigint
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
DECLARE
    j record;
    committed boolean;
    target bigint;
BEGIN
    FOR j IN
        SELECT *
          FROM jsonb_to_recordset(jobs)
               AS x(id bigint, token uuid, attempt integer, derived_key text,
                    derived_version text, sha256 text, width integer, height integer,
                    variants jsonb, original_width integer, original_height integer,
                    original_format text, original_frames integer,
                    original_has_alpha boolean, original_colour text,
                    original_placeholder text, original_dhash bigint)
    LOOP
        -- The fence and the attempt's event (`ready`, or `lease_lost` when the fence
        -- fails) in one statement, which also says whether the row re-derives a file.
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
                   error_code = NULL,
                   lease_token = NULL,
                   lease_until = NULL,
                   finished_at = now(),
                   updated_at = now()
             WHERE f.id = j.id AND f.lease_token = j.token  -- the fence (see the top)
            RETURNING f.attempts, f.rederive_of)
        INSERT INTO archive_events AS e (file_id, kind, attempt, lease_token)
        SELECT j.id, CASE WHEN d.attempts IS NULL THEN 'lease_lost' ELSE 'ready' END,
               coalesce(d.attempts, j.attempt), j.token
          FROM (SELECT) AS one LEFT JOIN done AS d ON true
        RETURNING e.kind = 'ready', (SELECT d.rederive_of FROM done AS d)
             INTO committed, target;
        CONTINUE WHEN NOT committed;
        IF target IS NOT NULL THEN
            -- A re-derivation: its job row is done with either way.
            DELETE FROM archive_files AS f WHERE f.id = j.id;
            PERFORM 1 FROM archive_files AS t
             WHERE t.id = target AND t.status = 'ready' FOR UPDATE;
            IF NOT FOUND THEN
                INSERT INTO archive_events (file_id, kind, attempt, lease_token)
                VALUES (j.id, 'lease_lost', j.attempt, j.token);
                CONTINUE;
            END IF;
            INSERT INTO derivd_retired_objects (key, file_id)
            SELECT a.key, a.file_id FROM archive_variants AS a WHERE a.file_id = target
            ON CONFLICT (key) DO NOTHING;
            DELETE FROM archive_variants AS a WHERE a.file_id = target;
            UPDATE archive_files AS f
               SET derived_key = j.derived_key,
                   derived_version = j.derived_version,
                   sha256 = j.sha256,
                   width = j.width,
                   height = j.height,
                   updated_at = now()
             WHERE f.id = target;
            INSERT INTO archive_events (file_id, kind, attempt, lease_token)
            VALUES (target, 'rederived', j.attempt, j.token);
        END IF;
        IF jsonb_array_length(coalesce(j.variants, '[]')) > 0 THEN
            INSERT INTO archive_variants AS a (file_id, name, format, content_type, key,
                                               version, sha256, width, height, lease_token,
                                               fingerprint)
            SELECT coalesce(target, j.id), v.name, v.format, v.content_type, v.key,
                   v.version, v.sha256, v.width, v.height, j.token, v.fingerprint
              FROM jsonb_to_recordset(j.variants)
                   AS v(name text, format text, content_type text, key text,
                        version text, sha256 text, width integer, height integer,
                        fingerprint text)
            ON CONFLICT (file_id, name, format) DO UPDATE
               SET key = EXCLUDED.key, version = EXCLUDED.version,
                   sha256 = EXCLUDED.sha256, width = EXCLUDED.width,
                   height = EXCLUDED.height, content_type = EXCLUDED.content_type,
                   lease_token = EXCLUDED.lease_token, fingerprint = EXCLUDED.fingerprint,
                   created_at = now();
            DELETE FROM pending_objects WHERE lease_token = j.token;
        END IF;
        RETURN NEXT j.id;
    END LOOP;
END $$;

-- The claim of up to `lim` rows (none when lim < 1), each with its own fresh token and
-- lease, and the file whose variants it makes (`file_id`: its own id, or rederive_of,
-- under whose prefix the worker stores them). Its caller decides durability (`claim` in
-- sql/queries.sql waits for no WAL flush; after a commit it is durable anyway).
-- `tenant_cap`: [queue] max_in_flight_per_tenant (0: none).
--
-- Claim order: expired leases under the attempt cap (the one statement that knows the
-- rule); then due queued rows by priority DESC, fair_rank, id; every 20th call
-- (derivd_claim_turns) by available_at, id instead. tenant_cap > 0: the candidates are
-- walked in that order (at most 4 x lim + 16), each tenant checked under a
-- transaction-scoped advisory lock (held to the end of the claim's transaction, so two
-- claims of one tenant count each other's rows; works through a transaction pooler), and
-- a tenant with tenant_cap rows `processing` skipped.
CREATE OR REPLACE FUNCTION derivd_claim(lim integer, lease_s float8, max_attempts integer,
                                        host text, tenant_cap integer)
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
    cand_ids bigint[];
    cand_since timestamptz[];
    cand_tenants text[];
    full_tenants text[] := '{}';
    locked_tenants text[] := '{}';
    chosen_tenants text[] := '{}';
    busy integer;
BEGIN
    IF lim < 1 THEN
        RETURN;
    END IF;
    oldest := nextval('derivd_claim_turns') % 20 = 0;
    -- Expired leases first, whatever the turn or the cap (their tenants' rows are
    -- `processing` already: reclaiming one adds nothing to its tenant's count).
    SELECT array_agg(e.id), array_agg(e.lease_until), array_agg(0) INTO ids, since, tiers
      FROM (SELECT f.id, f.lease_until
              FROM archive_files AS f
             WHERE f.status = 'processing' AND f.lease_until < now()
               AND f.attempts < derivd_claim.max_attempts
             ORDER BY f.lease_until
             LIMIT lim
               FOR UPDATE SKIP LOCKED) AS e;
    wanted := lim - coalesce(cardinality(ids), 0);
    IF wanted > 0 AND tenant_cap < 1 AND NOT oldest THEN
        -- (One statement per order rather than one with its order switched by a
        -- parameter: each is a plain ordered scan of its partial index.)
        SELECT ids || array_agg(q.id), since || array_agg(q.available_at),
               tiers || array_agg(1)
          INTO ids, since, tiers
          FROM (SELECT f.id, f.available_at
                  FROM archive_files AS f
                 WHERE f.status = 'queued' AND f.available_at <= now()
                 ORDER BY f.priority DESC, f.fair_rank, f.id
                 LIMIT wanted
                   FOR UPDATE SKIP LOCKED) AS q;
    ELSIF wanted > 0 AND tenant_cap < 1 THEN
        SELECT ids || array_agg(q.id), since || array_agg(q.available_at),
               tiers || array_agg(1)
          INTO ids, since, tiers
          FROM (SELECT f.id, f.available_at
                  FROM archive_files AS f
                 WHERE f.status = 'queued' AND f.available_at <= now()
                 ORDER BY f.available_at, f.id
                 LIMIT wanted
                   FOR UPDATE SKIP LOCKED) AS q;
    ELSIF wanted > 0 THEN
        IF oldest THEN
            SELECT array_agg(c.id), array_agg(c.available_at), array_agg(c.t)
              INTO cand_ids, cand_since, cand_tenants
              FROM (SELECT f.id, f.available_at, coalesce(f.tenant, '') AS t
                      FROM archive_files AS f
                     WHERE f.status = 'queued' AND f.available_at <= now()
                     ORDER BY f.available_at, f.id
                     LIMIT 4 * lim + 16) AS c;
        ELSE
            SELECT array_agg(c.id), array_agg(c.available_at), array_agg(c.t)
              INTO cand_ids, cand_since, cand_tenants
              FROM (SELECT f.id, f.available_at, coalesce(f.tenant, '') AS t
                      FROM archive_files AS f
                     WHERE f.status = 'queued' AND f.available_at <= now()
                     ORDER BY f.priority DESC, f.fair_rank, f.id
                     LIMIT 4 * lim + 16) AS c;
        END IF;
        FOR i IN 1 .. coalesce(array_length(cand_ids, 1), 0) LOOP
            EXIT WHEN coalesce(array_length(ids, 1), 0) >= lim;
            CONTINUE WHEN cand_tenants[i] = ANY (full_tenants);
            IF NOT cand_tenants[i] = ANY (locked_tenants) THEN
                PERFORM pg_advisory_xact_lock(
                    hashtextextended('derivd.tenant:' || cand_tenants[i], 0));
                locked_tenants := locked_tenants || cand_tenants[i];
            END IF;
            -- In flight: committed claims (after the lock: each statement sees what
            -- the claims that held it before committed), plus this call's own.
            SELECT count(*) INTO busy
              FROM archive_files AS p
             WHERE p.status = 'processing' AND coalesce(p.tenant, '') = cand_tenants[i];
            busy := busy + cardinality(array_positions(chosen_tenants, cand_tenants[i]));
            IF busy >= tenant_cap THEN
                full_tenants := full_tenants || cand_tenants[i];
                CONTINUE;
            END IF;
            PERFORM 1 FROM archive_files AS q
             WHERE q.id = cand_ids[i] AND q.status = 'queued'
               FOR UPDATE SKIP LOCKED;
            CONTINUE WHEN NOT FOUND;
            chosen_tenants := chosen_tenants || cand_tenants[i];
            ids := ids || cand_ids[i];
            since := since || cand_since[i];
            tiers := tiers || 1;
        END LOOP;
    END IF;
    IF ids IS NULL THEN
        RETURN;
    END IF;
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
              extract(epoch FROM now() - c.since)::float8, c.tier, c.since,
              coalesce(f.rederive_of, f.id);
    -- Under a tenant cap each claim records itself, with its row's tenant (migration
    -- 0015): the history in which a checker sees every tenant's rows in flight at every
    -- claim (harness.invariants). The event's id is drawn here, after this claim's
    -- tenant locks and counts, so id order is the order in which claims counted. The
    -- default claim records nothing (its cost per job is a measured budget).
    IF tenant_cap > 0 THEN
        INSERT INTO archive_events (file_id, kind, attempt, lease_token, tenant)
        SELECT f.id, 'claimed', f.attempts, f.lease_token, f.tenant
          FROM archive_files AS f
         WHERE f.id = ANY (ids);
    END IF;
END $$;

-- A worker's steady state in one round trip and one durable transaction: the fenced
-- commit of its finished attempts (derivd_commit), then the claim of up to `lim` next
-- rows (derivd_claim; lim = 0: commit only). The claim comes second and sees the commit:
-- a committed row is no longer claimable, a committed tenant's row no longer counts
-- against its cap. Rows: kind = 'committed' (id only) or 'claimed' (the claim's columns).
-- The signature without tenant_cap and file_id (below) stays, as a wrapper, for hosts
-- still on a release before 0014.
CREATE OR REPLACE FUNCTION derivd_commit_and_claim(jobs jsonb, lim integer, lease_s float8,
                                                   max_attempts integer, host text,
                                                   tenant_cap integer)
RETURNS TABLE (kind text, id bigint, lease_token uuid, attempts integer,
               original_key text, original_version text, wait_s float8, tier integer,
               claimable_since timestamptz, file_id bigint)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
    SELECT 'committed'::text, c.id, NULL::uuid, NULL::integer, NULL::text, NULL::text,
           NULL::float8, NULL::integer, NULL::timestamptz, NULL::bigint
      FROM derivd_commit(jobs) AS c(id);
    RETURN QUERY
    SELECT 'claimed'::text, c.*
      FROM derivd_claim(lim, lease_s, max_attempts, host, tenant_cap) AS c;
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
      FROM derivd_claim(lim, lease_s, max_attempts, host, 0) AS c
$$;

-- The fenced failure. retry: back to `queued` after delay_s unless the attempts are used
-- up; not retry (content errors): `rejected` at once. `code` is the final error code if
-- the row is rejected now; `extra_event` (e.g. 'timeout') is appended too. Returns the
-- new status, or no row when the fence failed (a `lease_lost` event is appended instead).
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
        INSERT INTO archive_events (file_id, kind, attempt, lease_token)
        VALUES (derivd_fail.file_id, 'lease_lost', derivd_fail.attempt, token);
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
-- fenced, a failed fence appends `lease_lost`. Returns whether it was released.
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
        INSERT INTO archive_events (file_id, kind, attempt, lease_token)
        VALUES (derivd_release.file_id, 'lease_lost', derivd_release.attempt, token);
        RETURN false;
    END IF;
    INSERT INTO archive_events (file_id, kind, attempt, lease_token)
    VALUES (derivd_release.file_id, 'released', n + 1, token);
    RETURN true;
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

-- == Queue health and the dashboard =====================================================

-- Queue health whose cost does not grow with history, cached for the fleet. A cached
-- result younger than max_age_s is returned as it is; otherwise the caller takes the
-- cache row's lock, and whoever waited for it finds the fresh result another host just
-- computed (one computation per interval for the whole fleet). Counts of the live states
-- are exact, from their partial indexes; the final states (ready, rejected, deleted) are
-- exact while the table is small (under 50,000 rows by the planner's statistics) and
-- planner estimates beyond (`estimated` lists which counts are). max_age_s = 0: compute
-- now.
CREATE OR REPLACE FUNCTION derivd_queue_stats(max_age_s float8)
RETURNS jsonb
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    result jsonb;
    total float8;
    counts jsonb;
BEGIN
    SELECT s.payload INTO result
      FROM derivd_stats_cache AS s
     WHERE s.name = 'queue' AND s.computed_at > now() - make_interval(secs => max_age_s);
    IF FOUND THEN
        RETURN result;
    END IF;
    SELECT s.payload INTO result
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
    RETURN result;
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
    SELECT s.payload INTO result
      FROM derivd_stats_cache AS s
     WHERE s.name = key AND s.computed_at > now() - make_interval(secs => max_age_s);
    IF FOUND THEN
        RETURN result;
    END IF;
    INSERT INTO derivd_stats_cache (name, computed_at, payload)
    VALUES (key, '-infinity', '{}')
    ON CONFLICT (name) DO NOTHING;
    SELECT s.payload INTO result
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
    RETURN result;
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
