-- A job's statements cost the server less: the vocabularies as domains, and the fenced
-- commit's UPDATE and event as one statement.
--
-- Why domains: PostgreSQL re-reads a table's CHECK constraints from their stored text
-- for every statement that writes the table (ExecRelCheck), and the four vocabulary
-- checks of 0001/0005 were the largest of those texts (an array of every status, kind or
-- code): ~10 % of a job's server CPU at claim_batch = 1 (perf of one backend). A domain's
-- constraint is compiled once per connection and kept (the type cache). The columns keep
-- their type (text): each table CHECK now casts to the domain, a short expression, and a
-- value outside the vocabulary is refused as before (check_violation, SQLSTATE 23514).
--
-- The domains are the one copy of each vocabulary in the database (derivd.states is the
-- Python one; tests/test_states.py compares them).
CREATE DOMAIN derivd_status AS text CONSTRAINT derivd_status_check CHECK (VALUE IN (
    'pending', 'queued', 'processing', 'ready', 'rejected', 'deleting', 'deleted'));
CREATE DOMAIN derivd_error_code AS text CONSTRAINT derivd_error_code_check CHECK (VALUE IN (
    'unsupported_content', 'corrupt_content', 'resource_limit', 'attempts_exhausted',
    'processing_failed'));
CREATE DOMAIN derivd_event_kind AS text CONSTRAINT derivd_event_kind_check CHECK (VALUE IN (
    'ready', 'retry', 'rejected', 'lease_lost', 'timeout', 'released', 'exhausted',
    'delete_requested', 'deleted', 'operator_retry'));

-- NOT VALID: every existing row passed the equivalent constraint dropped in the same
-- transaction, so the table (the fleet's history) is not scanned again; new and changed
-- rows are checked as before.
ALTER TABLE archive_files
    DROP CONSTRAINT archive_files_status_check,
    DROP CONSTRAINT archive_files_error_code_check,
    ADD CONSTRAINT archive_files_status_check
        CHECK (status::derivd_status IS NOT NULL) NOT VALID,
    ADD CONSTRAINT archive_files_error_code_check
        CHECK (error_code IS NULL OR error_code::derivd_error_code IS NOT NULL) NOT VALID;

ALTER TABLE archive_events
    DROP CONSTRAINT archive_events_kind_check,
    DROP CONSTRAINT archive_events_error_code_check,
    ADD CONSTRAINT archive_events_kind_check
        CHECK (kind::derivd_event_kind IS NOT NULL) NOT VALID,
    ADD CONSTRAINT archive_events_error_code_check
        CHECK (error_code IS NULL OR error_code::derivd_error_code IS NOT NULL) NOT VALID;

-- The worker's steady state (commit + next claim) in one function body. In 0008,
-- derivd_commit_and_claim called derivd_commit and derivd_claim: every job paid two more
-- function scans, tuplestores and plan_cache_mode changes, ~80 µs of a job's ~580 µs
-- in the server (pg_stat_statements, track = all). Now derivd_commit_and_claim holds
-- both, with the contract and fences of 0008, and derivd_commit and derivd_claim keep
-- their signatures (other callers, and hosts still on the previous release) as thin
-- wrappers over it: one copy of each piece of logic.
--
-- Changed in the commit: each job's fenced UPDATE and its event (`ready`, or
-- `lease_lost` when the fence fails) are one statement, and the attempt's write-ahead
-- entries are cleared only when it stored variants (an attempt registers pending objects
-- exactly for the variants it PUTs: derivd.jobs._store). lim = 0: commit only.
CREATE OR REPLACE FUNCTION derivd_commit_and_claim(jobs jsonb, lim integer, lease_s float8,
                                                   max_attempts integer, host text)
RETURNS TABLE (kind text, id bigint, lease_token uuid, attempts integer,
               original_key text, original_version text, wait_s float8, tier integer,
               claimable_since timestamptz)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
DECLARE
    j record;
    committed boolean;
    ids bigint[];
    since timestamptz[];
    tiers integer[];
BEGIN
    FOR j IN
        SELECT *
          FROM jsonb_to_recordset(jobs)
               AS x(id bigint, token uuid, attempt integer, derived_key text,
                    derived_version text, sha256 text, width integer, height integer,
                    variants jsonb)
    LOOP
        WITH done AS (
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
             WHERE f.id = j.id AND f.lease_token = j.token  -- the fence (see 0008)
            RETURNING f.attempts)
        INSERT INTO archive_events AS e (file_id, kind, attempt, lease_token)
        SELECT j.id, CASE WHEN d.attempts IS NULL THEN 'lease_lost' ELSE 'ready' END,
               coalesce(d.attempts, j.attempt), j.token
          FROM (SELECT) AS one LEFT JOIN done AS d ON true
        RETURNING e.kind = 'ready' INTO committed;
        CONTINUE WHEN NOT committed;
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
            DELETE FROM pending_objects WHERE lease_token = j.token;
        END IF;
        kind := 'committed';
        id := j.id;
        RETURN NEXT;
    END LOOP;
    IF lim < 1 THEN
        RETURN;
    END IF;
    -- The claim (as in 0008): one statement picks and locks the rows (the second branch
    -- is only read for what the first leaves of the limit), one UPDATE by primary key.
    -- It sees the commit above: a committed row is no longer claimable.
    SELECT array_agg(c.id), array_agg(c.since), array_agg(c.tier) INTO ids, since, tiers
      FROM (SELECT * FROM (SELECT f.id, f.lease_until AS since, 0 AS tier
                             FROM archive_files AS f
                            WHERE f.status = 'processing' AND f.lease_until < now()
                              AND f.attempts < derivd_commit_and_claim.max_attempts
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
           lease_until = now() + make_interval(secs => derivd_commit_and_claim.lease_s),
           attempts = f.attempts + 1,
           claimed_at = now(),
           claimed_by = derivd_commit_and_claim.host,
           updated_at = now()
      FROM unnest(ids, since, tiers) AS c(id, since, tier)
     WHERE f.id = c.id
    RETURNING 'claimed'::text, f.id, f.lease_token, f.attempts, f.original_key,
              f.original_version, extract(epoch FROM now() - c.since)::float8, c.tier,
              c.since;
END $$;

-- The fenced commit alone (contract of 0008): the ids that committed.
CREATE OR REPLACE FUNCTION derivd_commit(jobs jsonb)
RETURNS SETOF bigint
LANGUAGE sql AS $$
    SELECT c.id FROM derivd_commit_and_claim(jobs, 0, 0, 0, NULL) AS c
$$;

-- The claim alone (contract of 0008); its caller decides durability (sql/queries.sql).
CREATE OR REPLACE FUNCTION derivd_claim(lim integer, lease_s float8, max_attempts integer,
                                        host text)
RETURNS TABLE (id bigint, lease_token uuid, attempts integer, original_key text,
               original_version text, wait_s float8, tier integer,
               claimable_since timestamptz)
LANGUAGE sql AS $$
    SELECT c.id, c.lease_token, c.attempts, c.original_key, c.original_version, c.wait_s,
           c.tier, c.claimable_since
      FROM derivd_commit_and_claim('[]', lim, lease_s, max_attempts, host) AS c
$$;
