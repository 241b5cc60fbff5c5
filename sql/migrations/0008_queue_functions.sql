-- The lease protocol as server-side functions: the claim, the fenced commit, the commit of
-- a batch with the claim of the next one, the fenced failure and the fenced release.
--
-- Why functions: at claim_batch = 1 the server's CPU per job was mostly parsing and
-- planning large CTE statements (2.5x more through a transaction pooler, where nothing
-- can be prepared). PL/pgSQL prepares each statement of a function once per server
-- connection and keeps the plan, whichever client (or pooler) calls it; the client sends
-- one small `SELECT * FROM derivd_x(...)`. Each function body is a few short statements
-- whose plans are primary-key or partial-index lookups.
--
-- Fences are unchanged: a commit, failure or release changes a row only while it is
-- `processing` under the caller's token (a failed fence appends `lease_lost`); every
-- claimed row gets its own fresh token and lease; times are the database's. The fence is
-- written `id = ... AND lease_token = token`: archive_files_lease_check (0001) makes a
-- row hold a lease token exactly while it is `processing`, so the token match is the
-- status check, and it keeps the plan on the primary key (with `status = 'processing'`
-- spelled out, a generic plan may scan the partial index of every processing row).
--
-- #variable_conflict use_column: inside the bodies an unqualified name is a column (the
-- OUT parameters of RETURNS TABLE share their names with columns).
--
-- plan_cache_mode = force_generic_plan: every statement inside is planned once per server
-- connection, its plan kept (left to choose, the server re-planned custom plans for some
-- statements at every call). The plans are index lookups whatever the parameters: the
-- primary key, or the partial indexes of queued and processing rows. A function's SET
-- clause undoes every local setting made inside it on return, which is why the claim's
-- synchronous_commit is set by the calling statement, not in derivd_claim.

-- Lease up to `lim` claimable rows: expired leases still under the attempt cap first
-- (their worker died), then the oldest queued rows that are due. wait_s is how long the
-- row had been claimable (queue wait); tier and claimable_since give the claim order.
-- Durability is the caller's: the `claim` statement (sql/queries.sql) turns the WAL flush
-- wait off for a claim alone; after a commit (derivd_commit_and_claim) it stays durable.
CREATE FUNCTION derivd_claim(lim integer, lease_s float8, max_attempts integer, host text)
RETURNS TABLE (id bigint, lease_token uuid, attempts integer, original_key text,
               original_version text, wait_s float8, tier integer,
               claimable_since timestamptz)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
DECLARE
    ids bigint[];
    since timestamptz[];
    tiers integer[];
BEGIN
    -- One statement picks and locks the rows: the second branch is only read for what
    -- the first leaves of the limit (the outer LIMIT stops pulling, and a row is locked
    -- only when pulled).
    SELECT array_agg(c.id), array_agg(c.since), array_agg(c.tier) INTO ids, since, tiers
      FROM (SELECT * FROM (SELECT f.id, f.lease_until AS since, 0 AS tier
                             FROM archive_files AS f
                            WHERE f.status = 'processing' AND f.lease_until < now()
                              AND f.attempts < derivd_claim.max_attempts
                            ORDER BY f.lease_until
                            LIMIT lim
                              FOR UPDATE SKIP LOCKED) AS expired
            UNION ALL
            SELECT * FROM (SELECT f.id, f.available_at, 1
                             FROM archive_files AS f
                            WHERE f.status = 'queued' AND f.available_at <= now()
                            ORDER BY f.available_at, f.id
                            LIMIT lim
                              FOR UPDATE SKIP LOCKED) AS due
            LIMIT lim) AS c;
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
              extract(epoch FROM now() - c.since)::float8, c.tier, c.since;
END $$;

-- The fenced commit of one or more finished attempts (`jobs`: a JSON array of
-- {id, token, attempt, derived_key, derived_version, sha256, width, height, variants}).
-- Each row is fenced on its own id + token + status; for a row that passes, its variants
-- are recorded, its attempt's write-ahead entries cleared and a `ready` event appended. A
-- row whose fence fails changes nothing but gets a `lease_lost` event. Returns the ids
-- that committed. The caller's transaction is durable (nothing here turns it off).
CREATE FUNCTION derivd_commit(jobs jsonb)
RETURNS SETOF bigint
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
DECLARE
    j record;
    n integer;
BEGIN
    FOR j IN
        SELECT *
          FROM jsonb_to_recordset(jobs)
               AS x(id bigint, token uuid, attempt integer, derived_key text,
                    derived_version text, sha256 text, width integer, height integer,
                    variants jsonb)
    LOOP
        UPDATE archive_files AS f
           SET status = 'ready',
               derived_key = j.derived_key,
               derived_version = j.derived_version,
               sha256 = j.sha256,
               width = j.width,
               height = j.height,
               error_code = NULL,
               lease_token = NULL,
               lease_until = NULL,
               finished_at = now(),
               updated_at = now()
         WHERE f.id = j.id AND f.lease_token = j.token  -- the fence (see above)
        RETURNING f.attempts INTO n;
        IF NOT FOUND THEN
            INSERT INTO archive_events (file_id, kind, attempt, lease_token)
            VALUES (j.id, 'lease_lost', j.attempt, j.token);
            CONTINUE;
        END IF;
        IF jsonb_array_length(coalesce(j.variants, '[]')) > 0 THEN
            INSERT INTO archive_variants AS a (file_id, name, format, content_type, key,
                                               version, sha256, width, height, lease_token)
            SELECT j.id, v.name, v.format, v.content_type, v.key, v.version, v.sha256,
                   v.width, v.height, j.token
              FROM jsonb_to_recordset(j.variants)
                   AS v(name text, format text, content_type text, key text,
                        version text, sha256 text, width integer, height integer)
            ON CONFLICT (file_id, name, format) DO UPDATE
               SET key = EXCLUDED.key, version = EXCLUDED.version,
                   sha256 = EXCLUDED.sha256, width = EXCLUDED.width,
                   height = EXCLUDED.height, content_type = EXCLUDED.content_type,
                   lease_token = EXCLUDED.lease_token, created_at = now();
        END IF;
        -- Written ahead by this attempt only (an attempt with no variants wrote none,
        -- but the lookup by token is one probe of a small index: kept unconditional).
        DELETE FROM pending_objects WHERE lease_token = j.token;
        INSERT INTO archive_events (file_id, kind, attempt, lease_token)
        VALUES (j.id, 'ready', n, j.token);
        RETURN NEXT j.id;
    END LOOP;
END $$;

-- A worker's steady state in one round trip and one durable transaction: derivd_commit
-- of its finished attempts, then derivd_claim of up to `lim` next rows (it sees the
-- commit: a committed row is no longer claimable; it stays durable because the commit
-- wrote first). Rows: kind = 'committed' (id only) or 'claimed' (the claim's columns).
CREATE FUNCTION derivd_commit_and_claim(jobs jsonb, lim integer, lease_s float8,
                                        max_attempts integer, host text)
RETURNS TABLE (kind text, id bigint, lease_token uuid, attempts integer,
               original_key text, original_version text, wait_s float8, tier integer,
               claimable_since timestamptz)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    RETURN QUERY
    SELECT 'committed'::text, c, NULL::uuid, NULL::integer, NULL::text, NULL::text,
           NULL::float8, NULL::integer, NULL::timestamptz
      FROM derivd_commit(jobs) AS c;
    RETURN QUERY
    SELECT 'claimed'::text, c.*
      FROM derivd_claim(lim, lease_s, max_attempts, host) AS c;
END $$;

-- The fenced failure. retry: back to `queued` after delay_s unless the attempts are used
-- up; not retry (content errors): `rejected` at once. `code` is the final error code if
-- the row is rejected now; `extra_event` (e.g. 'timeout') is appended too. Returns the
-- new status, or no row when the fence failed (a `lease_lost` event is appended instead).
CREATE FUNCTION derivd_fail(file_id bigint, token uuid, attempt integer, retry boolean,
                            code text, max_attempts integer, delay_s float8,
                            extra_event text)
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

-- Give a job back (shutdown, or too little lease left) without burning its attempt;
-- fenced, a failed fence appends `lease_lost`. Returns whether it was released.
CREATE FUNCTION derivd_release(file_id bigint, token uuid, attempt integer)
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

-- Queue health whose cost does not grow with history, cached for the fleet (replaces the
-- one large `queue_stats` statement of 0005, whose planning dominated its cost: here each
-- statement is planned once per server connection). A cached result younger than
-- max_age_s is returned as it is; otherwise the caller takes the cache row's lock, and
-- whoever waited for it finds the fresh result another host just computed (one
-- computation per interval for the whole fleet). Counts of the live states are exact,
-- from their partial indexes; the final states (ready, rejected, deleted) are exact while
-- the table is small (under 50,000 rows by the planner's statistics) and planner
-- estimates beyond (`estimated` lists which counts are). max_age_s = 0: compute now.
CREATE FUNCTION derivd_queue_stats(max_age_s float8)
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

-- Nothing in derivd reads events by file (status, metrics and the dashboard read recent
-- events through the BRIN index on `at`; the client reads archive_files and
-- archive_variants): this btree only cost every job an index insert.
DROP INDEX archive_events_file_at;
