-- Production traffic (issue 20): a priority and a tenant per file, fair ranks that share
-- the claims between tenants, a fleet-wide share of claims for the oldest work (the
-- starvation bound), and re-derivations of `ready` files that never take them out of
-- `ready` (backfill). docs/traffic.md says why this shape; DESIGN.md is the contract.
--
-- Every column is added without rewriting the table (NULL, or a constant default), and
-- every CHECK is NOT VALID: the rows already there hold the defaults, which pass.

-- == Priority and tenant ==============================================================
-- priority: higher runs first, -100..100 (derivd.queue.traffic.PRIORITY_MIN/MAX).
-- tenant: optional, 1..200 characters, no control characters (it is shown by status).
-- fair_rank: given by the trigger below when the row enters `queued`; claim order
-- within a priority. rederive_of: this row re-derives the variants of that (ready) file.
ALTER TABLE archive_files
    ADD COLUMN priority    smallint NOT NULL DEFAULT 0,
    ADD COLUMN tenant      text,
    ADD COLUMN fair_rank   bigint,
    ADD COLUMN rederive_of bigint,
    ADD CONSTRAINT archive_files_priority_check CHECK (priority BETWEEN -100 AND 100) NOT VALID,
    ADD CONSTRAINT archive_files_tenant_check CHECK (
        tenant IS NULL OR (char_length(tenant) BETWEEN 1 AND 200 AND tenant !~ '[[:cntrl:]]'))
        NOT VALID;

-- Rows queued before this migration get ranks in their old claim order (due time).
UPDATE archive_files AS f
   SET fair_rank = r.n
  FROM (SELECT id, row_number() OVER (ORDER BY available_at, id) AS n
          FROM archive_files WHERE status = 'queued') AS r
 WHERE f.id = r.id;

-- The claim's order: priority, then the fair rank (partial: queued rows only, like
-- archive_files_claimable, which stays for the oldest-first share and the statistics).
CREATE INDEX archive_files_claim_order ON archive_files (priority DESC, fair_rank, id)
    WHERE status = 'queued';
-- A tenant's last rank at a priority: one descent for the rank trigger.
CREATE INDEX archive_files_tenant_rank
    ON archive_files (priority, (coalesce(tenant, '')), fair_rank)
    WHERE status = 'queued';

-- The fair rank of a row entering `queued` (insert, or pending -> queued): right after
-- its tenant's last queued row at its priority, and never before the frontier (the
-- lowest rank due at that priority). A tenant that arrives starts at the frontier, so
-- its rows interleave with those of a tenant that holds many: the claim, one ordered
-- scan, then alternates between them. Rows that come back to `queued` (retry, release,
-- operator retry) keep their rank. Ties (same rank) go by id.
CREATE FUNCTION archive_files_fair_rank() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    frontier bigint;
    last_rank bigint;
BEGIN
    SELECT f.fair_rank INTO frontier
      FROM archive_files AS f
     WHERE f.status = 'queued' AND f.priority = NEW.priority AND f.available_at <= now()
     ORDER BY f.priority DESC, f.fair_rank, f.id
     LIMIT 1;
    SELECT f.fair_rank INTO last_rank
      FROM archive_files AS f
     WHERE f.status = 'queued' AND f.priority = NEW.priority
       AND coalesce(f.tenant, '') = coalesce(NEW.tenant, '')
     ORDER BY f.priority, coalesce(f.tenant, ''), f.fair_rank DESC
     LIMIT 1;
    NEW.fair_rank := greatest(coalesce(frontier, 0), coalesce(last_rank + 1, 0));
    RETURN NEW;
END $$;

CREATE TRIGGER archive_files_fair_rank BEFORE INSERT OR UPDATE OF status ON archive_files
    FOR EACH ROW WHEN (NEW.status = 'queued' AND NEW.fair_rank IS NULL)
    EXECUTE FUNCTION archive_files_fair_rank();

-- The starvation bound: every CLAIM_SHARE-th claim call of the fleet takes the oldest
-- due rows whatever their priority or tenant. A sequence: exact across hosts, no row
-- lock, no WAL per call.
CREATE SEQUENCE derivd_claim_turns CYCLE;

-- == Re-derivations (backfill) ========================================================
-- At most one live re-derivation per file; `derivd delete` finds them all.
CREATE UNIQUE INDEX archive_files_rederive_live ON archive_files (rederive_of)
    WHERE status IN ('queued', 'processing');
CREATE INDEX archive_files_rederive ON archive_files (rederive_of)
    WHERE rederive_of IS NOT NULL;

-- What spec made each variant (derivd.fingerprint); NULL: made before this migration.
ALTER TABLE archive_variants ADD COLUMN fingerprint text;

-- Objects of a variant set that a re-derivation replaced: still readable by clients that
-- read the old keys a moment ago; the sweep removes them after [sweep] delete_guard.
CREATE TABLE derivd_retired_objects (
    key        text        PRIMARY KEY,
    file_id    bigint      NOT NULL,
    retired_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX derivd_retired_objects_age ON derivd_retired_objects (retired_at);

-- One row per backfill (`derivd backfill --apply`): what it aims at (`target`: a digest
-- of the configured variant set), where it is (`cursor`: the last file id it planned)
-- and what it did. A run resumes the unfinished row of the same target.
CREATE TABLE derivd_backfills (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    target      text        NOT NULL,
    cursor      bigint      NOT NULL DEFAULT 0,
    last_id     bigint      NOT NULL,
    scanned     bigint      NOT NULL DEFAULT 0,
    queued      bigint      NOT NULL DEFAULT 0,
    started_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz
);

-- `rederived`: on the file, when a re-derivation swapped its variant set in.
ALTER DOMAIN derivd_event_kind DROP CONSTRAINT derivd_event_kind_check;
ALTER DOMAIN derivd_event_kind ADD CONSTRAINT derivd_event_kind_check CHECK (VALUE IN (
    'ready', 'retry', 'rejected', 'lease_lost', 'timeout', 'released', 'exhausted',
    'delete_requested', 'deleted', 'operator_retry', 'rederived'));

-- == The claim and the commit ========================================================
-- derivd_commit_and_claim gains `tenant_cap` ([queue] max_in_flight_per_tenant) and
-- returns `file_id`: the file whose variants the job makes (its own id, or rederive_of),
-- under whose prefix the worker stores them. The signatures of 0008/0010 stay as
-- wrappers for hosts still on the previous release (no cap, no file_id).
--
-- Claim order: expired leases under the attempt cap; then due queued rows by priority
-- DESC, fair_rank, id; every 20th call (derivd_claim_turns) by available_at, id instead.
-- tenant_cap > 0: the candidates are walked in that order (at most 4 x lim + 16), each
-- tenant checked under a transaction-scoped advisory lock (held to the end of the
-- claim's transaction, so two claims of one tenant count each other's rows; works
-- through a transaction pooler), and a tenant with tenant_cap rows `processing` skipped.
--
-- Commit of a re-derivation (rederive_of set): under the file's row lock, while the file
-- is still `ready`, its variants are replaced by the new ones (the old objects go to
-- derivd_retired_objects), its derived_* updated and a `rederived` event appended to it;
-- the job row is then deleted. A file no longer ready (deleted meanwhile) keeps what it
-- has: the job row is deleted with a `lease_lost` event and its objects are left to the
-- orphan sweep. Either way the job row's fence (id + token) is checked first.
CREATE FUNCTION derivd_commit_and_claim(jobs jsonb, lim integer, lease_s float8,
                                        max_attempts integer, host text,
                                        tenant_cap integer)
RETURNS TABLE (kind text, id bigint, lease_token uuid, attempts integer,
               original_key text, original_version text, wait_s float8, tier integer,
               claimable_since timestamptz, file_id bigint)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
DECLARE
    j record;
    n integer;
    target bigint;
    oldest boolean;
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
    FOR j IN
        SELECT *
          FROM jsonb_to_recordset(jobs)
               AS x(id bigint, token uuid, attempt integer, derived_key text,
                    derived_version text, sha256 text, width integer, height integer,
                    variants jsonb)
    LOOP
        -- The fence (see 0008) and the job row's event in one statement; a
        -- re-derivation's events are written below, once its file is checked.
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
             WHERE f.id = j.id AND f.lease_token = j.token
            RETURNING f.attempts, f.rederive_of
        ), logged AS (
            INSERT INTO archive_events AS e (file_id, kind, attempt, lease_token)
            SELECT j.id, CASE WHEN d.attempts IS NULL THEN 'lease_lost' ELSE 'ready' END,
                   coalesce(d.attempts, j.attempt), j.token
              FROM (SELECT) AS one LEFT JOIN done AS d ON true
             WHERE d.rederive_of IS NULL
            RETURNING 1
        )
        SELECT d.attempts, d.rederive_of INTO n, target
          FROM (SELECT) AS one LEFT JOIN done AS d ON true;
        CONTINUE WHEN n IS NULL;
        IF target IS NOT NULL THEN
            -- A re-derivation: its job row is done with either way.
            DELETE FROM archive_files AS f WHERE f.id = j.id;
            PERFORM 1 FROM archive_files AS t
             WHERE t.id = target AND t.status = 'ready' FOR UPDATE;
            IF NOT FOUND THEN
                INSERT INTO archive_events (file_id, kind, attempt, lease_token)
                VALUES (j.id, 'lease_lost', n, j.token);
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
            VALUES (target, 'rederived', n, j.token);
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
        kind := 'committed';
        id := j.id;
        RETURN NEXT;
    END LOOP;
    IF lim < 1 THEN
        RETURN;
    END IF;
    oldest := nextval('derivd_claim_turns') % 20 = 0;
    IF tenant_cap < 1 THEN
        -- One statement picks and locks the rows; a branch is read only for what the
        -- ones before it leave of the limit, and the two last ones exclude each other.
        SELECT array_agg(c.id), array_agg(c.since), array_agg(c.tier)
          INTO ids, since, tiers
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
                                  AND NOT oldest
                                ORDER BY f.priority DESC, f.fair_rank, f.id
                                LIMIT lim
                                  FOR UPDATE SKIP LOCKED) AS ranked
                UNION ALL
                SELECT * FROM (SELECT f.id, f.available_at, 1
                                 FROM archive_files AS f
                                WHERE f.status = 'queued' AND f.available_at <= now()
                                  AND oldest
                                ORDER BY f.available_at, f.id
                                LIMIT lim
                                  FOR UPDATE SKIP LOCKED) AS oldest_first
                LIMIT lim) AS c;
    ELSE
        SELECT array_agg(e.id), array_agg(e.since), array_agg(0) INTO ids, since, tiers
          FROM (SELECT f.id, f.lease_until AS since
                  FROM archive_files AS f
                 WHERE f.status = 'processing' AND f.lease_until < now()
                   AND f.attempts < derivd_commit_and_claim.max_attempts
                 ORDER BY f.lease_until
                 LIMIT lim
                   FOR UPDATE SKIP LOCKED) AS e;
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
           lease_until = now() + make_interval(secs => derivd_commit_and_claim.lease_s),
           attempts = f.attempts + 1,
           claimed_at = now(),
           claimed_by = derivd_commit_and_claim.host,
           updated_at = now()
      FROM unnest(ids, since, tiers) AS c(id, since, tier)
     WHERE f.id = c.id
    RETURNING 'claimed'::text, f.id, f.lease_token, f.attempts, f.original_key,
              f.original_version, extract(epoch FROM now() - c.since)::float8, c.tier,
              c.since, coalesce(f.rederive_of, f.id);
END $$;

-- The claim alone, with the tenant cap and the file id (its caller decides durability).
CREATE FUNCTION derivd_claim(lim integer, lease_s float8, max_attempts integer, host text,
                             tenant_cap integer)
RETURNS TABLE (id bigint, lease_token uuid, attempts integer, original_key text,
               original_version text, wait_s float8, tier integer,
               claimable_since timestamptz, file_id bigint)
LANGUAGE sql AS $$
    SELECT c.id, c.lease_token, c.attempts, c.original_key, c.original_version, c.wait_s,
           c.tier, c.claimable_since, c.file_id
      FROM derivd_commit_and_claim('[]', lim, lease_s, max_attempts, host, tenant_cap) AS c
$$;

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

CREATE OR REPLACE FUNCTION derivd_commit(jobs jsonb)
RETURNS SETOF bigint
LANGUAGE sql AS $$
    SELECT c.id FROM derivd_commit_and_claim(jobs, 0, 0, 0, NULL, 0) AS c
$$;

CREATE OR REPLACE FUNCTION derivd_claim(lim integer, lease_s float8, max_attempts integer,
                                        host text)
RETURNS TABLE (id bigint, lease_token uuid, attempts integer, original_key text,
               original_version text, wait_s float8, tier integer,
               claimable_since timestamptz)
LANGUAGE sql AS $$
    SELECT c.id, c.lease_token, c.attempts, c.original_key, c.original_version, c.wait_s,
           c.tier, c.claimable_since
      FROM derivd_commit_and_claim('[]', lim, lease_s, max_attempts, host, 0) AS c
$$;
