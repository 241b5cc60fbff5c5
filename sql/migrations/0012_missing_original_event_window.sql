-- Two changes: the error code `missing_original`, and the recent-events counts cached for
-- the fleet (derivd_event_window, below).
--
-- A new error code, `missing_original`: the original cannot be read, for good (no such
-- key, no such version, or a key the store refuses). Until now such a row either ended
-- `processing_failed` at once (a missing object) or was retried as an outage until its
-- attempts ran out (a key the store refuses): an operator could not tell "the upload API
-- queued something that is not there" from "the backend is broken".
--
-- Only the domain changes: no column has the domain's type (the table CHECKs of 0010
-- cast to it), so replacing its constraint reads no row and is instant. Hosts of the
-- previous release never write the new code.
ALTER DOMAIN derivd_error_code DROP CONSTRAINT derivd_error_code_check;
ALTER DOMAIN derivd_error_code ADD CONSTRAINT derivd_error_code_check CHECK (VALUE IN (
    'unsupported_content', 'corrupt_content', 'resource_limit', 'missing_original',
    'attempts_exhausted', 'processing_failed'));

-- The recent-events counts behind `derivd status`, the dashboard and the metrics (events
-- per kind, and rejections per error code, over the last `window_s` seconds), cached for
-- the fleet like derivd_queue_stats (0008): a result younger than max_age_s is returned
-- as it is; otherwise the caller takes the cache row's lock, and whoever waited for it
-- finds the result another host (or probe) just computed. One row per window. Every
-- caller used to count the window's events itself, in two statements: ~120 ms at 100
-- jobs/s with the default one-hour window, paid by each health probe (bench/RESULTS.md,
-- "derivd status as a health probe"). Now one scan per max_age_s for everyone.
CREATE FUNCTION derivd_event_window(window_s float8, max_age_s float8)
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
