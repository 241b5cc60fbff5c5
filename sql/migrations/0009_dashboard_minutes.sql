-- The dashboard's chart as a function whose cost does not grow with the table.
--
-- Before: every finishing event of the last hour was joined to its archive_files row for
-- the median duration; once the hour held ~100k events the planner hashed the whole
-- table (0.9 s at 1M rows, ~10x that at 10M). Now the counts come from the events alone
-- (the hour's window, capped at `cap` events) and the median of each minute from at most
-- `sample` of its latest ready/rejected jobs, each looked up by primary key: the cost is
-- bounded by the window and 60 x `sample` index probes, whatever the history.
--
-- SET jit = off: the probes' estimated cost crosses jit_above_cost, and compiling this
-- one statement took longer (~0.7 s) than running it. A function's SET clause applies
-- while it is planned and run, through a pooler too (no session setting).
CREATE FUNCTION derivd_finished_per_minute(cap integer, sample integer)
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
