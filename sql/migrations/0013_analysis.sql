-- The analysis of the original (DESIGN.md "Analysis"), stored on its row by the fenced
-- commit: what an app needs when a file becomes `ready` (the displayed size to reserve
-- layout space, a placeholder to paint before the variants load, a representative colour)
-- and a perceptual hash to spot re-uploads (derivd.client.similar).
--
-- `original_` like original_key: they describe the original, while width/height (0001)
-- describe the primary variant. All eight are set together or not at all: a handler that
-- analyses nothing (noop, a third-party one returning a plain list) commits NULLs.
--
-- Plain types and one NOT VALID CHECK, so that this migration neither rewrites nor scans
-- archive_files (the fleet's history) under its ACCESS EXCLUSIVE lock: a column of a domain
-- type with a constraint makes PostgreSQL 15 rewrite the table on ADD COLUMN, and a CHECK
-- added VALID scans it. Every row has NULLs here, which the CHECK accepts. The worker
-- checks the same rules before it commits (derivd.analysis), so a handler's malformed
-- analysis is its job's `processing_failed`, never a failed commit statement.
--   colour       "#rrggbb", lower-case hex, sRGB
--   placeholder  ThumbHash bytes in base64: 17-25 bytes are 24-36 characters (padding
--                optional); the bound keeps a handler from bloating an update-heavy row
--   format       a short lower-case name (jpeg, png, gif, webp, tiff, avif, heic, ...)
--   dhash        64-bit difference hash as a signed bigint (any value)
ALTER TABLE archive_files
    ADD COLUMN original_width       integer,
    ADD COLUMN original_height      integer,
    ADD COLUMN original_format      text,
    ADD COLUMN original_frames      integer,
    ADD COLUMN original_has_alpha   boolean,
    ADD COLUMN original_colour      text,
    ADD COLUMN original_placeholder text,
    ADD COLUMN original_dhash       bigint,
    ADD CONSTRAINT archive_files_original_check CHECK (
        num_nulls(original_width, original_height, original_format, original_frames,
                  original_has_alpha, original_colour, original_placeholder,
                  original_dhash) = 8
        OR (original_width > 0 AND original_height > 0 AND original_frames > 0
            AND original_format ~ '^[a-z0-9]{1,16}$'
            AND original_has_alpha IS NOT NULL
            AND original_colour ~ '^#[0-9a-f]{6}$'
            AND original_placeholder ~ '^[A-Za-z0-9+/]{16,64}={0,2}$'
            AND original_dhash IS NOT NULL)) NOT VALID;

-- derivd.client.similar: the other ready files within `max_distance` bits of a file's
-- dhash, nearest first (then by id); none when the file has no dhash. `#` is XOR and
-- bit_count of the bigint as bit(64) counts the differing bits.
--
-- By default a (parallel) scan of the ready rows (bench/similar.py: ~0.6 s at 1M rows
-- on 2 cores).
-- A deployment that asks often creates the optional index of the README,
-- archive_files_dhash_bands: a GIN index on the dhash's four 16-bit bands, each tagged
-- with its position (derivd_dhash_bands). Two hashes within 7 bits agree on some band to
-- within one bit (pigeonhole: 4 bands x 2 bits = 8), so the rows whose bands meet the
-- file's 68 probes (each band's value and its 16 one-bit neighbours: derivd_dhash_probes)
-- hold every answer up to 7 bits; the exact distance then filters them. It makes similar
-- ~14x faster at 1M rows and costs each commit ~20 % more WAL, which is why it is not
-- created here. Without the index the band filter would be slower than the plain scan, so
-- it is used only when the index exists.
-- Not STRICT: PostgreSQL then inlines it (no function call per row, and the index's
-- expression and the query's match).
CREATE FUNCTION derivd_dhash_bands(h bigint) RETURNS integer[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT ARRAY[(h & 65535)::integer, (65536 | ((h >> 16) & 65535))::integer,
                 (131072 | ((h >> 32) & 65535))::integer,
                 (196608 | ((h >> 48) & 65535))::integer]
$$;

CREATE FUNCTION derivd_dhash_probes(h bigint) RETURNS integer[]
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT array_agg(((b << 16) | (((h >> (16 * b)) & 65535) # m))::integer)
      FROM generate_series(0, 3) AS b,
           (SELECT 0 AS m UNION ALL SELECT 1 << k FROM generate_series(0, 15) AS k) AS flips
$$;

-- The band probe, serial: the planner expects thousands of rows where it reads a few
-- hundred, and plans parallel workers that take longer to start (~150 ms on 2 cores)
-- than the whole probe (~10 ms at 1M rows). The SET is this function's alone.
CREATE FUNCTION derivd_similar_near(h bigint, file_id bigint, max_distance integer)
RETURNS SETOF bigint
LANGUAGE sql STABLE SET max_parallel_workers_per_gather = 0 AS $$
    SELECT f.id FROM archive_files AS f
     WHERE derivd_dhash_bands(f.original_dhash) && derivd_dhash_probes(h)
       AND f.original_dhash IS NOT NULL AND f.status = 'ready' AND f.id <> file_id
       AND bit_count((f.original_dhash # h)::bit(64)) <= max_distance
     ORDER BY bit_count((f.original_dhash # h)::bit(64)), f.id
$$;

CREATE FUNCTION derivd_similar(file_id bigint, max_distance integer)
RETURNS SETOF bigint
LANGUAGE plpgsql STABLE AS $$
DECLARE
    h bigint;
BEGIN
    SELECT f.original_dhash INTO h FROM archive_files AS f WHERE f.id = file_id;
    IF h IS NULL THEN
        RETURN;
    END IF;
    IF max_distance <= 7 AND to_regclass('archive_files_dhash_bands') IS NOT NULL THEN
        RETURN QUERY SELECT n.id FROM derivd_similar_near(h, file_id, max_distance) AS n(id);
    ELSE
        RETURN QUERY
        SELECT f.id FROM archive_files AS f
         WHERE f.status = 'ready' AND f.id <> file_id
           AND bit_count((f.original_dhash # h)::bit(64)) <= max_distance
         ORDER BY bit_count((f.original_dhash # h)::bit(64)), f.id;
    END IF;
END $$;

-- The fenced commit stores the analysis sent with each job (keys absent, as from a host
-- of the previous release: NULLs). Otherwise the body of 0010, fences unchanged;
-- derivd_commit and derivd_claim (0010) wrap it and keep their signatures.
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
                    variants jsonb, original_width integer, original_height integer,
                    original_format text, original_frames integer,
                    original_has_alpha boolean, original_colour text,
                    original_placeholder text, original_dhash bigint)
    LOOP
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
