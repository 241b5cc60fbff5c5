-- Fleet scale: everything works through a transaction-mode pooler, queue statistics
-- whose cost does not grow with history, and an event log that can shed old days.

-- == Leases on named duties (the sweep) ============================================
-- A session-level advisory lock does not survive a transaction pooler (the session
-- belongs to the pooler, not to the sweeper). A lease row does: taken and renewed by one
-- statement each, fenced by the holder's random id, and free again once `until` passes
-- (a sweeper that dies frees it after one lease).
CREATE TABLE derivd_leases (
    name   text        PRIMARY KEY,
    holder uuid        NOT NULL,
    until  timestamptz NOT NULL
);

-- == Queue statistics ================================================================
-- Exact counts of the live states come from partial indexes (small: they hold only the
-- rows in that state); `pending` had none. `deleted` rows are purged by age
-- ([sweep] purge_deleted_days), which this index finds without reading the history.
CREATE INDEX archive_files_pending ON archive_files (id) WHERE status = 'pending';
CREATE INDEX archive_files_deleted ON archive_files (finished_at) WHERE status = 'deleted';

-- One row per shared gauge set: the host that finds it stale recomputes it (the row lock
-- makes the others wait for that one computation, then read its result), so a fleet
-- computes the queue statistics once per interval instead of once per host.
CREATE TABLE derivd_stats_cache (
    name        text        PRIMARY KEY,
    computed_at timestamptz NOT NULL,
    payload     jsonb       NOT NULL
);
INSERT INTO derivd_stats_cache (name, computed_at, payload)
VALUES ('queue', '-infinity', '{}');

-- == archive_events: daily partitions ===============================================
-- Events stay append-only (UPDATE, DELETE and TRUNCATE refused on every partition), and
-- `[sweep] events_retention_days` drops whole days: DROP TABLE of a partition rewrites
-- nothing and leaves no dead rows. Partition `archive_events_to_YYYYMMDD` holds the day
-- before that date (UTC); the sweep creates them ahead. The DEFAULT partition catches
-- rows no partition covers (only if sweeps stopped for longer than they create ahead):
-- nothing is ever refused, and it is dropped whole once its newest row is past retention.
-- No primary key: nothing looks events up by id, and each index costs every job.
ALTER TABLE archive_events RENAME TO archive_events_v1;

CREATE TABLE archive_events (
    id          bigint GENERATED ALWAYS AS IDENTITY,
    file_id     bigint      NOT NULL,
    at          timestamptz NOT NULL DEFAULT now(),
    kind        text        NOT NULL,
    attempt     integer,
    lease_token uuid,
    error_code  text,
    actor       text,
    CONSTRAINT archive_events_kind_check CHECK (kind IN (
        'ready', 'retry', 'rejected', 'lease_lost', 'timeout', 'released',
        'exhausted', 'delete_requested', 'deleted', 'operator_retry')),
    CONSTRAINT archive_events_error_code_check CHECK (error_code IS NULL OR error_code IN (
        'unsupported_content', 'corrupt_content', 'resource_limit',
        'attempts_exhausted', 'processing_failed'))
) PARTITION BY RANGE (at);
CREATE INDEX archive_events_file_at ON archive_events (file_id, at);
CREATE INDEX archive_events_at_brin ON archive_events USING brin (at);
CREATE TRIGGER archive_events_no_update BEFORE UPDATE OR DELETE ON archive_events
    FOR EACH ROW EXECUTE FUNCTION archive_events_append_only();
CREATE TRIGGER archive_events_no_truncate BEFORE TRUNCATE ON archive_events
    FOR EACH STATEMENT EXECUTE FUNCTION archive_events_append_only();

-- Row triggers are cloned onto every partition; a statement trigger is not, so each
-- partition gets its own TRUNCATE guard.
CREATE FUNCTION derivd_guard_partition(part regclass) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE format('CREATE TRIGGER archive_events_no_truncate BEFORE TRUNCATE ON %s '
                   'FOR EACH STATEMENT EXECUTE FUNCTION archive_events_append_only()', part);
END $$;

CREATE TABLE archive_events_default PARTITION OF archive_events DEFAULT;
SELECT derivd_guard_partition('archive_events_default');

-- Daily partitions for `days` days from `first` (UTC dates), unless present. A day whose
-- rows already sit in the DEFAULT partition is left there (creating its partition would
-- have to move them). Returns the partitions created.
CREATE FUNCTION derivd_event_partitions(first date, days integer)
RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE
    d date;
    part text;
    low timestamptz;
    high timestamptz;
BEGIN
    FOR i IN 0 .. days - 1 LOOP
        d := first + i;
        part := 'archive_events_to_' || to_char(d + 1, 'YYYYMMDD');
        low := d::timestamp AT TIME ZONE 'UTC';
        high := (d + 1)::timestamp AT TIME ZONE 'UTC';
        CONTINUE WHEN to_regclass(part) IS NOT NULL;
        CONTINUE WHEN EXISTS (SELECT 1 FROM archive_events_default
                               WHERE at >= low AND at < high);
        EXECUTE format('CREATE TABLE %I PARTITION OF archive_events FOR VALUES FROM (%L) TO (%L)',
                       part, low, high);
        PERFORM derivd_guard_partition(part::regclass);
        RETURN NEXT part;
    END LOOP;
END $$;

-- Drop the partitions that end on or before `cutoff`, whole, and the DEFAULT partition
-- when its newest row is older than `cutoff` (recreated empty). Returns what it dropped.
CREATE FUNCTION derivd_drop_event_partitions(cutoff timestamptz)
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
    IF (SELECT max(at) < cutoff FROM archive_events_default) THEN
        DROP TABLE archive_events_default;
        CREATE TABLE archive_events_default PARTITION OF archive_events DEFAULT;
        PERFORM derivd_guard_partition('archive_events_default');
        RETURN NEXT 'archive_events_default';
    END IF;
END $$;

-- What was logged before this migration becomes one partition ending today (dropped
-- whole once today is past retention); then today and the week ahead.
DO $$
DECLARE
    today date := (now() AT TIME ZONE 'UTC')::date;
    part text := 'archive_events_to_' || to_char(today, 'YYYYMMDD');
BEGIN
    PERFORM derivd_event_partitions(today, 8);
    IF EXISTS (SELECT 1 FROM archive_events_v1) THEN
        EXECUTE format('CREATE TABLE %I PARTITION OF archive_events FOR VALUES FROM (MINVALUE) '
                       'TO (%L)', part, today::timestamp AT TIME ZONE 'UTC');
        PERFORM derivd_guard_partition(part::regclass);
        INSERT INTO archive_events (file_id, at, kind, attempt, lease_token, error_code, actor)
        SELECT file_id, at, kind, attempt, lease_token, error_code, actor
          FROM archive_events_v1 ORDER BY id;
    END IF;
END $$;
DROP TABLE archive_events_v1;
