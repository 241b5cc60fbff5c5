-- Event partitions that recover from a long outage of the duty that makes them (issue 21, item 12).
--
-- Why: partitions are made 8 days ahead; a fleet whose partition rounds stopped for
-- longer (sweep off, supervisors down while workers of an older release ran) logged its
-- events into archive_events_default. derivd_event_partitions then skipped every day
-- that DEFAULT held rows of (creating it would have to move them), so those days kept
-- landing in DEFAULT, and DEFAULT was dropped only once its newest row was past
-- retention: with one recent row it held the old ones forever.
--
-- Now each round moves DEFAULT's rows out: derivd_rehome_default_events swaps in an
-- empty DEFAULT partition, creates the day partition of every day the old one held
-- (within retention), copies those rows there (ids kept) and drops the old table with
-- whatever was past retention. Every DDL statement here takes ACCESS EXCLUSIVE on
-- archive_events, so the caller runs each function under a short lock_timeout
-- (derivd.queue.db.DDL_LOCK_TIMEOUT_S) and retries later rather than queue every job's
-- commit behind a long reader. Two hosts doing this at once serialise on a
-- transaction-scoped advisory lock (it holds through a transaction pooler); the second
-- finds nothing left to do.

CREATE OR REPLACE FUNCTION derivd_event_partitions(first date, days integer)
RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE
    d date;
    part text;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('derivd_event_partitions'));
    FOR i IN 0 .. days - 1 LOOP
        d := first + i;
        part := 'archive_events_to_' || to_char(d + 1, 'YYYYMMDD');
        CONTINUE WHEN to_regclass(part) IS NOT NULL;
        -- A day DEFAULT holds rows of waits for derivd_rehome_default_events.
        CONTINUE WHEN EXISTS (SELECT 1 FROM archive_events_default
                               WHERE at >= d::timestamp AT TIME ZONE 'UTC'
                                 AND at < (d + 1)::timestamp AT TIME ZONE 'UTC');
        PERFORM derivd_event_partition(d);
        RETURN NEXT part;
    END LOOP;
END $$;

-- The partition of one UTC day, guarded like every other; its name.
CREATE OR REPLACE FUNCTION derivd_event_partition(d date)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    part text := 'archive_events_to_' || to_char(d + 1, 'YYYYMMDD');
BEGIN
    IF to_regclass(part) IS NULL THEN
        EXECUTE format('CREATE TABLE %I PARTITION OF archive_events FOR VALUES FROM (%L) TO (%L)',
                       part, d::timestamp AT TIME ZONE 'UTC', (d + 1)::timestamp AT TIME ZONE 'UTC');
        PERFORM derivd_guard_partition(part::regclass);
    END IF;
    RETURN part;
END $$;

-- Empty the DEFAULT partition: its rows from `cutoff` on (every row when cutoff is NULL:
-- no retention) move to the partitions of their days, the rest is dropped with the old
-- table. Returns the day partitions that received rows (none when DEFAULT was empty).
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
