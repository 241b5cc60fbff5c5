-- Every query derivd runs. Blocks start with `-- name: <name>`; the comment lines that
-- follow say what the query is for. Parameters are psycopg named placeholders; `{name}`
-- is an identifier composed with psycopg.sql.Identifier, never text pasted in. Only
-- derivd.queue executes these (supervisor/queue/statements.py); nothing else in derivd
-- builds SQL. Blocks are grouped by the module of derivd.queue that sends them.
--
-- The lease protocol's bodies (derivd_claim, derivd_commit, ...) and the triggers' are in
-- sql/functions.sql, the tables in sql/schema.sql. The fence is `id + lease_token`
-- everywhere, here as in the functions: archive_files_lease_check makes a row hold a
-- token exactly while it is `processing`, so a token match is the status check, and the
-- plan stays on the primary key (functions.sql says more).

-- == connecting: pooler detection and the supervisor's bounds (derivd.queue.session, derivd.queue.statements) ==

-- name: backend_pid
-- The server process behind this statement. Through a pooler it differs from the
-- process id the connection was given at start-up (the pooler makes that one up).
SELECT pg_backend_pid() AS pid;

-- name: lock_timeout
-- How long the statements after it in this transaction may wait for a lock (partition
-- DDL takes ACCESS EXCLUSIVE on archive_events: it gives up rather than queue every
-- job's commit behind a long reader, and is retried later).
SELECT set_config('lock_timeout', %(timeout)s, true);

-- name: session_timeouts
-- Bounds for a direct connection of the supervisor (never sent through a pooler, where
-- a session setting would stick to a server connection other clients share).
SELECT set_config('statement_timeout', %(statement)s, false),
       set_config('lock_timeout', %(lock)s, false);

-- name: generic_plans
-- A worker's direct connection plans each statement once: psycopg prepares a statement
-- from its fifth call, and PostgreSQL would plan it again on every call whenever a
-- custom plan for the values looks cheaper (the claim's write-ahead CTE, pruned when a
-- noop worker registers nothing: ~6 % of a job's server CPU). Never through a pooler,
-- where a session setting would stick to a server connection other clients share.
SELECT set_config('plan_cache_mode', 'force_generic_plan', false);

-- == migrate and the schema check (derivd.queue.schema) ==

-- name: migrations_lock
-- Serialise `derivd migrate` across hosts: a transaction-scoped advisory lock.
SELECT pg_advisory_xact_lock(hashtext('derivd.migrate'));

-- name: migrations_table
-- The ledger of applied migrations.
CREATE TABLE IF NOT EXISTS derivd_migrations (
    name       text PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: pin_search_path
-- [database] schema: every function of sql/functions.sql (`signatures`) looks its names
-- up in the schema it lives in (derivd_pin_search_path).
SELECT derivd_pin_search_path(%(signatures)s::text[]);

-- name: current_schema
-- Where `migrate` creates what it creates (the first schema of the search_path).
SELECT current_schema();

-- name: migrations_key_prefix
-- The store's key prefix for migration 0025 (transaction-local: nothing else sees it).
SELECT set_config('derivd.key_prefix', %(prefix)s::text, true);

-- name: migrations_applied
SELECT name FROM derivd_migrations ORDER BY name;

-- name: migrations_exists
-- Whether the ledger exists at all (a database never migrated has none).
SELECT to_regclass('derivd_migrations') IS NOT NULL AS present;

-- name: migrations_record
INSERT INTO derivd_migrations (name) VALUES (%(name)s);

-- name: functions_missing
-- Which of the functions this derivd calls (`signatures`: those of sql/functions.sql, as
-- `name(argument types)`) the database lacks. A release may add a function or an overload
-- without a migration; its hosts must not start before `derivd migrate` has created it.
SELECT s AS signature
  FROM unnest(%(signatures)s::text[]) AS s
 WHERE to_regprocedure(s) IS NULL
 ORDER BY s;

-- == LISTEN (derivd.queue.listener) ==

-- name: listen
-- Listen on `{channel}`: derivd.queue.db's QUEUED_CHANNEL (the supervisor's wake-up: the
-- trigger archive_files_notify_queued notifies it whenever a row enters `queued`) or
-- FINISHED_CHANNEL (derivd.client.wait: archive_files_notify_finished sends a row's id
-- when it becomes ready, rejected, deleting or deleted, if a waiter registered it).
LISTEN {channel};

-- == the lease protocol, as a worker calls it (derivd.queue.worker_queries) ==

-- name: claim
-- Lease up to `limit` claimable rows (expired leases under the attempt cap first, then
-- due queued rows by priority and fair rank, every 20th call the oldest due ones; at
-- most `tenant_cap` in flight per tenant, 0: no cap), each with its own fresh token and
-- lease, and the file each works for (derivd_claim in sql/functions.sql). The claim
-- alone commits without waiting for its WAL flush (synchronous_commit off for this one
-- transaction only): a claim lost in a server crash just leaves the rows as they were,
-- and each attempt's fenced commit, fail or release, all durable, flush it anyway. That
-- halves the flushes a job waits for; the fence (the token) is untouched.
-- `prefix_format`: each claimed attempt's key prefix goes to the write-ahead registry
-- in the same transaction (derivd_claim), not flushed here: the worker registers its
-- keys itself unless a durable statement of its connection has ended since
-- (derivd.worker, "write-ahead"). NULL: no prefix (a backend that stores no objects).
SELECT c.*
  FROM set_config('synchronous_commit', 'off', true) AS no_flush_wait,
       derivd_claim(%(limit)s::integer, %(lease_s)s::float8, %(max_attempts)s::integer,
                    %(host)s::text, %(tenant_cap)s::integer, %(prefix_format)s::text) AS c;

-- name: register_pending
-- Write-ahead: the keys an attempt is about to PUT, so a crash leaves a trail to sweep,
-- durable. They replace the attempt's prefix registered by its claim (the keys name
-- everything it will write).
WITH prefix AS (
    DELETE FROM pending_objects
     WHERE lease_token = %(token)s AND right(key, 1) = '/'
)
INSERT INTO pending_objects (key, file_id, lease_token)
SELECT k, %(id)s, %(token)s FROM unnest(%(keys)s::text[]) AS k
ON CONFLICT (key) DO NOTHING;

-- name: commit
-- The fenced commit of one or more finished attempts (`jobs`: a JSON array of
-- {id, token, attempt, derived_key, derived_version, sha256, width, height, variants}),
-- durable; each row passes or fails its own fence (derivd_commit_outcomes in
-- sql/functions.sql). Returns the ids that committed, and the re-derivations refused.
SELECT c.outcome AS kind, c.id
  FROM derivd_commit_outcomes(%(jobs)s::jsonb) AS c
 WHERE c.outcome <> 'lost';

-- name: commit_and_claim
-- A worker's steady state in one round trip and one durable transaction: the fenced
-- commit (as `commit`), then the claim (as `claim`, `prefix_format` too, here flushed
-- with the commit). Rows: kind = 'committed' or 'rejected' (id) or 'claimed' (the
-- claim's columns). The two function scans run in the order written (an Append runs its
-- children one after the other), so the claim sees the commit: a committed row is no
-- longer claimable, a committed tenant's row no longer counts against its cap.
-- (derivd_commit_and_claim in sql/functions.sql composes the same two for hosts of
-- earlier releases, with a layer this statement does without.)
SELECT o.outcome AS kind, o.id, NULL::uuid AS lease_token, NULL::integer AS attempts,
       NULL::text AS original_key, NULL::text AS original_version, NULL::float8 AS wait_s,
       NULL::integer AS tier, NULL::timestamptz AS claimable_since, NULL::bigint AS file_id
  FROM derivd_commit_outcomes(%(jobs)s::jsonb) AS o
 WHERE o.outcome <> 'lost'
UNION ALL
SELECT 'claimed', c.*
  FROM derivd_claim(%(limit)s::integer, %(lease_s)s::float8, %(max_attempts)s::integer,
                    %(host)s::text, %(tenant_cap)s::integer, %(prefix_format)s::text) AS c;

-- name: fail
-- The fenced failure (derivd_fail in sql/functions.sql). retry = true: back to `queued`
-- after delay_s unless the attempts are used up; retry = false (content errors):
-- `rejected` at once. `extra_event` (e.g. 'timeout') is appended too. Returns the new
-- status, or no row when the fence failed (a `lease_lost` event is appended instead).
SELECT status, error_code
  FROM derivd_fail(%(id)s::bigint, %(token)s::uuid, %(attempt)s::integer, %(retry)s::boolean,
                   %(code)s::text, %(max_attempts)s::integer, %(delay_s)s::float8,
                   %(extra_event)s::text);

-- name: release
-- Give a job back during shutdown without burning its attempt (derivd_release in
-- sql/functions.sql; fenced, a failed fence appends `lease_lost`).
SELECT derivd_release(%(id)s::bigint, %(token)s::uuid, %(attempt)s::integer)::int AS released;

-- name: not_yet_due
-- What a `run --burst` leaves behind once nothing is claimable: queued rows whose retry
-- delay has not passed (counted to 10,000) and in how many seconds the first is due,
-- both through the partial index of queued rows.
SELECT (SELECT count(*) FROM (SELECT 1 FROM archive_files
                               WHERE status = 'queued' AND available_at > now()
                               LIMIT 10000) AS q)::int AS waiting,
       extract(epoch FROM (SELECT min(available_at) FROM archive_files
                            WHERE status = 'queued' AND available_at > now())
                          - now())::float8 AS next_due_s;

-- == the heartbeat, the host registry, a dead worker's jobs (derivd.queue.host_queries) ==

-- name: worker_died
-- A dead worker's job, returned by its supervisor (derivd_worker_died in
-- sql/functions.sql): `worker_died`, then back to `queued` after delay_s with the attempt
-- counted, or `rejected` attempts_exhausted on its last one. No row: the fence failed.
SELECT status, error_code
  FROM derivd_worker_died(%(id)s::bigint, %(token)s::uuid, %(attempt)s::integer,
                          %(max_attempts)s::integer, %(delay_s)s::float8);

-- name: heartbeat
-- One call per host every [queue] heartbeat (derivd_heartbeat in sql/functions.sql):
-- which of the jobs this host holds (`jobs`: a JSON array of {id, token, file}, running
-- and claimed-unstarted) still hold their lease, fenced by id + token; with `renew`,
-- exactly those leases are extended to now() + lease_s. The host's registry row is
-- refreshed (created if pruned), fenced on the run that owns it: with `started_at` (a
-- supervisor's, from register_host) only the row of this pid and start; another run's
-- row under the same name is never taken over. Returns the ids whose lease still holds,
-- and the ids whose attempt has just ended itself (committed, failed or released by that
-- very token); every other id sent is lost.
SELECT id FROM derivd_heartbeat(%(jobs)s::jsonb, %(renew)s::boolean, %(lease_s)s::float8,
                                %(host)s::text, %(pid)s::integer, %(version)s::text,
                                %(backend)s::text, %(workers)s::integer, %(busy)s::integer,
                                %(heartbeat_s)s::float8, %(started_at)s::timestamptz) AS id;

-- name: host_holder
-- The registry row under a name, for a supervisor about to start under it.
SELECT pid, version, started_at, heartbeat_s,
       extract(epoch FROM now() - last_heartbeat)::float8 AS heartbeat_age_s,
       NOT derivd_host_stale(last_heartbeat, heartbeat_s) AS alive
  FROM derivd_hosts
 WHERE host = %(host)s;

-- name: register_host
-- A supervisor starts: its registry row, idle and started now. Fenced: it replaces only
-- the row it was shown (`seen_pid` + `seen_started_at`: a stale one, or its own crashed
-- run's), never one another run has written since; nothing returned: try again.
INSERT INTO derivd_hosts AS r (host, pid, version, backend, workers, busy, heartbeat_s,
                               variant_set)
VALUES (%(host)s, %(pid)s, %(version)s, %(backend)s, %(workers)s, 0, %(heartbeat_s)s,
        %(variant_set)s)
ON CONFLICT (host) DO UPDATE
   SET pid = EXCLUDED.pid, version = EXCLUDED.version, backend = EXCLUDED.backend,
       workers = EXCLUDED.workers, busy = 0, heartbeat_s = EXCLUDED.heartbeat_s,
       last_heartbeat = now(), started_at = now(), variant_set = EXCLUDED.variant_set
 WHERE r.pid = %(seen_pid)s AND r.started_at = %(seen_started_at)s::timestamptz
RETURNING started_at;

-- name: host_variant_set
-- A supervisor's variant set changed (a reload), or its row was made again by a
-- heartbeat after a prune: the registry learns it. Fenced on the run, as the heartbeat.
UPDATE derivd_hosts
   SET variant_set = %(variant_set)s
 WHERE host = %(host)s AND pid = %(pid)s
   AND (%(started_at)s::timestamptz IS NULL OR started_at = %(started_at)s::timestamptz)
RETURNING host;

-- name: live_variant_sets
-- `derivd backfill`: the variant set of every live host (NULL: unknown).
SELECT host, variant_set FROM derivd_hosts
 WHERE NOT derivd_host_stale(last_heartbeat, heartbeat_s)
 ORDER BY host;

-- name: deregister_host
-- A clean stop. Fenced on the pid and the start: a supervisor under the same name (a
-- newer one, or one on another machine) keeps its row.
DELETE FROM derivd_hosts
 WHERE host = %(host)s AND pid = %(pid)s
   AND (%(started_at)s::timestamptz IS NULL OR started_at = %(started_at)s::timestamptz);

-- name: prune_hosts
-- Rows of hosts that stopped heartbeating (stale: derivd_host_stale) for longer than the
-- guard.
DELETE FROM derivd_hosts
 WHERE derivd_host_stale(last_heartbeat, heartbeat_s)
   AND last_heartbeat < now() - make_interval(secs => %(guard_s)s)
RETURNING host;

-- name: hosts
-- The registry for `derivd status` and the metrics: alive = not stale (derivd_host_stale:
-- a heartbeat within three of its intervals); in_flight = rows it holds in `processing`
-- (via the partial indexes), re-derivations included.
SELECT h.host, h.pid, h.version, h.backend, h.workers, h.busy, h.started_at,
       extract(epoch FROM now() - h.last_heartbeat)::float8 AS heartbeat_age_s,
       NOT derivd_host_stale(h.last_heartbeat, h.heartbeat_s) AS alive,
       ((SELECT count(*) FROM archive_files AS f
          WHERE f.status = 'processing' AND f.claimed_by = h.host)
        + (SELECT count(*) FROM derivd_rederivations AS q
            WHERE q.status = 'processing' AND q.claimed_by = h.host))::int AS in_flight
  FROM derivd_hosts AS h
 ORDER BY h.host;

-- name: record_lease_lost
-- The supervisor killed a job whose lease the heartbeat found gone: a `lease_lost`
-- event, unless the lease is (still) this attempt's after all (the fence: id + token).
INSERT INTO archive_events (file_id, kind, attempt, lease_token)
SELECT %(id)s, 'lease_lost', %(attempt)s, %(token)s
 WHERE NOT EXISTS (SELECT 1 FROM archive_files
                    WHERE id = %(id)s AND lease_token = %(token)s)
   AND NOT EXISTS (SELECT 1 FROM derivd_rederivations
                    WHERE id = %(id)s AND lease_token = %(token)s)
RETURNING 1;

-- == the duties and the sweep (derivd.queue.maintenance_queries) ==

-- name: reject_exhausted
-- Rows whose worker died on their last allowed attempt: reject instead of reclaiming, so
-- a file that crashes its worker every time stops after max_attempts runs. Each file by
-- derivd_file_final (its event, its outbox), fenced on the expired lease's token.
WITH expired AS (
    SELECT id, lease_token
      FROM archive_files
     WHERE status = 'processing' AND lease_until < now()
       AND NOT derivd_attempts_left(attempts, %(max_attempts)s)
     ORDER BY lease_until
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), done AS (
    SELECT e.id
      FROM expired AS e
     WHERE derivd_file_final(e.id, e.lease_token, NULL, 'rejected', 'attempts_exhausted',
                             'exhausted', NULL) IS NOT NULL
), jobs_expired AS (
    -- Re-derivations the same way; the job is rejected, never its file (which keeps its
    -- set and gets `rederive_rejected`, not counted as a file's rejection).
    SELECT id, lease_token
      FROM derivd_rederivations
     WHERE status = 'processing' AND lease_until < now()
       AND NOT derivd_attempts_left(attempts, %(max_attempts)s)
     ORDER BY lease_until
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), jobs_done AS (
    UPDATE derivd_rederivations AS q
       SET status = 'rejected',
           error_code = 'attempts_exhausted',
           lease_token = NULL,
           lease_until = NULL,
           finished_at = now(),
           updated_at = now()
      FROM jobs_expired AS e
     WHERE q.id = e.id
    RETURNING q.id, q.file_id, q.attempts, e.lease_token
), jobs_event AS (
    INSERT INTO archive_events (file_id, kind, attempt, lease_token, error_code)
    SELECT file_id, 'rederive_rejected', attempts, lease_token, 'attempts_exhausted'
      FROM jobs_done
    RETURNING 1
)
SELECT id FROM done
UNION ALL
SELECT id FROM jobs_done;

-- name: orphans_due
-- Objects written by attempts that never committed, older than the guard, and whose
-- attempt can no longer commit (its token is not a live lease). Not a fence: a search by
-- token, and `status = 'processing'` is what lets it read the partial index of
-- processing rows instead of the whole table (no index holds every token).
SELECT p.key
  FROM pending_objects AS p
 WHERE p.created_at < now() - make_interval(secs => %(guard_s)s)
   AND NOT EXISTS (SELECT 1 FROM archive_files AS f
                    WHERE f.lease_token = p.lease_token AND f.status = 'processing')
   AND NOT EXISTS (SELECT 1 FROM derivd_rederivations AS q
                    WHERE q.lease_token = p.lease_token AND q.status = 'processing')
 ORDER BY p.created_at
 LIMIT %(limit)s;

-- name: forget_orphans
DELETE FROM pending_objects WHERE key = ANY(%(keys)s::text[]);

-- name: deletions_due
-- Rows in `deleting` for longer than the guard, with the keys the cleaner must remove.
-- A re-derivation's row has no original of its own (it shares its file's): NULL.
SELECT id, CASE WHEN rederive_of IS NULL THEN original_key END AS original_key
  FROM archive_files
 WHERE status = 'deleting' AND updated_at < now() - make_interval(secs => %(guard_s)s)
 ORDER BY updated_at
 LIMIT %(limit)s;

-- name: mark_deleted
-- The last step of a deletion, after its objects are gone: derivd_file_final, fenced on
-- `deleting` (a second sweeper finds nothing to do). Write-ahead entries are kept on
-- purpose: an attempt that was still running may PUT after this, and only the orphan
-- sweep (whose guard exceeds the lease) is sure to see its objects.
SELECT (derivd_file_final(%(id)s::bigint, NULL, 'deleting', 'deleted', NULL, 'deleted',
                          NULL) IS NOT NULL)::int AS deleted;

-- name: lease_take
-- Take (or renew, for the same holder) a named lease such as the sweep's: one statement,
-- so it holds through a transaction-mode pooler. Another holder's lease is taken only
-- once it has expired; two racing takers serialise on the row and the second sees the
-- first's lease. No row returned: someone else holds it.
INSERT INTO derivd_leases AS l (name, holder, until)
VALUES (%(name)s, %(holder)s, now() + make_interval(secs => %(ttl_s)s))
ON CONFLICT (name) DO UPDATE
   SET holder = EXCLUDED.holder, until = EXCLUDED.until
 WHERE l.until < now() OR l.holder = EXCLUDED.holder
RETURNING holder;

-- name: lease_drop
-- Give a lease back (fenced on the holder: a lease taken over meanwhile stays).
DELETE FROM derivd_leases WHERE name = %(name)s AND holder = %(holder)s RETURNING holder;

-- name: event_partitions
-- Create the daily archive_events partitions from `first` (default: today, UTC, database
-- time) for `days` days (the sweep keeps a week ahead). Returns the ones created.
SELECT derivd_event_partitions(
           coalesce(%(first)s::date, (now() AT TIME ZONE 'UTC')::date), %(days)s) AS created;

-- name: drop_event_partitions
-- Drop whole the partitions of events older than `days` days (none when days is 0).
SELECT derivd_drop_event_partitions(now() - make_interval(days => %(days)s)) AS dropped
 WHERE %(days)s > 0;

-- name: purge_deleted
-- Remove `deleted` rows (no objects left, nothing to show) finished more than `days`
-- days ago, a batch at a time; their variants are gone already, events stay.
DELETE FROM archive_files
 WHERE id IN (SELECT id FROM archive_files
               WHERE status = 'deleted'
                 AND finished_at < now() - make_interval(days => %(days)s)
               ORDER BY finished_at
               LIMIT %(limit)s)
RETURNING id;

-- name: retired_due
-- Objects of variant sets a re-derivation replaced, retired longer than the guard ago.
SELECT key FROM derivd_retired_objects
 WHERE retired_at < now() - make_interval(secs => %(guard_s)s)
 ORDER BY retired_at
 LIMIT %(limit)s;

-- name: forget_retired
DELETE FROM derivd_retired_objects WHERE key = ANY(%(keys)s::text[]);

-- name: rehome_default_events
-- Move the DEFAULT partition's rows to the partitions of their days, dropping those
-- older than `days` days (every row moves when days is 0). Returns the day partitions
-- that received rows (derivd_rehome_default_events, sql/functions.sql).
SELECT derivd_rehome_default_events(
           CASE WHEN %(days)s > 0 THEN now() - make_interval(days => %(days)s) END) AS part;

-- name: default_events
-- Whether the DEFAULT partition holds events (days no partition covered: the partition
-- duty was away longer than it creates ahead): `derivd status` warns.
SELECT EXISTS (SELECT 1 FROM archive_events_default) AS present;

-- == producers and operators (derivd.queue.operator_queries) ==

-- name: enqueue
-- Queue confirmed originals (key and version already stored), all at one priority and
-- tenant (NULL: none), with one external id and metadata (NULL: none). Returns the new ids in order. Their write-ahead entries (what
-- `derivd enqueue` registered before the PUTs: enqueue_write_ahead) go in the same
-- statement: an original is either queued or still in the orphan registry, never neither.
WITH confirmed AS (
    DELETE FROM pending_objects WHERE key = ANY(%(keys)s::text[])
)
INSERT INTO archive_files (status, original_key, original_version, priority, tenant,
                           external_id, metadata)
SELECT 'queued', k, v, %(priority)s, %(tenant)s, %(external_id)s, %(metadata)s::jsonb
  FROM unnest(%(keys)s::text[], %(versions)s::text[]) WITH ORDINALITY AS t(k, v, n)
 ORDER BY n
RETURNING id;

-- name: enqueue_write_ahead
-- Originals about to be uploaded (`derivd enqueue`), registered before their PUTs as a
-- worker registers its variants: an upload interrupted before its rows are inserted
-- leaves them to the orphan sweep (after [sweep] orphan_guard; `token` is no lease, so
-- nothing keeps them). file_id 0: no file yet. `enqueue` clears them.
INSERT INTO pending_objects (key, file_id, lease_token)
SELECT k, 0, %(token)s FROM unnest(%(keys)s::text[]) AS k
ON CONFLICT (key) DO NOTHING;

-- name: request_delete
-- `derivd delete`: the deletion every app calls too (derivd_delete in sql/functions.sql).
SELECT id FROM derivd_delete(%(ids)s::bigint[], %(actor)s::text) AS id;

-- name: operator_retry
-- Operator's retry: rejected rows (by id, or all, optionally of one code) go back to
-- `queued` with their attempts reset; who did it goes to the events. A row without a
-- key or version stays rejected (no attempt could read it; the row's rule refuses it
-- queued: archive_files_original_key_check), left out so the others still go.
WITH done AS (
    UPDATE archive_files
       SET status = 'queued', attempts = 0, error_code = NULL, available_at = now(),
           finished_at = NULL, updated_at = now(),
           fair_rank = coalesce(fair_rank, 0)  -- rejected before migration 0014: none
     WHERE status = 'rejected'
       AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
       AND (%(code)s::text IS NULL OR error_code = %(code)s::text)
       AND original_key <> '' AND coalesce(original_version, '') <> ''
    RETURNING id
), retry_event AS (
    INSERT INTO archive_events (file_id, kind, attempt, actor)
    SELECT id, 'operator_retry', 0, %(actor)s FROM done
    RETURNING 1
)
SELECT id FROM done ORDER BY id;

-- name: rederive_retry
-- Operator's retry of rejected re-derivations (all, optionally of one code): back to
-- `queued` with their attempts reset, the event on the job (its file is ready all the
-- while). Returns the files whose re-derivation was queued again.
WITH done AS (
    UPDATE derivd_rederivations
       SET status = 'queued', attempts = 0, error_code = NULL, available_at = now(),
           finished_at = NULL, ended_token = NULL, updated_at = now()
     WHERE status = 'rejected'
       AND (%(code)s::text IS NULL OR error_code = %(code)s::text)
    RETURNING id, file_id
), retry_event AS (
    INSERT INTO archive_events (file_id, kind, attempt, actor)
    SELECT id, 'operator_retry', 0, %(actor)s FROM done
    RETURNING 1
)
SELECT file_id AS id FROM done ORDER BY file_id;

-- name: file_statuses
-- The current status of each given id that exists (operators' commands report the rest
-- as unknown).
SELECT id, status FROM archive_files WHERE id = ANY(%(ids)s::bigint[]) ORDER BY id;

-- name: queue_stats
-- Queue health whose cost does not grow with history, cached for the fleet: a result
-- another host computed less than max_age_s ago is reused (0: compute now). Live
-- counts exact, final states planner estimates on a big table (derivd_queue_stats in
-- sql/functions.sql).
SELECT derivd_queue_stats(%(max_age_s)s::float8) AS payload;

-- name: event_window
-- The last `window_s` seconds of events, cached for the fleet like queue_stats (a result
-- computed less than max_age_s ago is reused; 0: compute now): how many of each kind
-- (lease_lost, timeout, ...), and the rejections (`rejected` and `exhausted` events) by
-- error code, which tell bad input (unsupported/corrupt/limit) from an upload API that
-- queues what is not stored (missing_original) and a broken backend (processing_failed)
-- (derivd_event_window in sql/functions.sql).
SELECT derivd_event_window(%(window_s)s::float8, %(max_age_s)s::float8) AS payload;

-- name: file_row
SELECT id, status, attempts, available_at, lease_token, lease_until, original_key,
       original_version, derived_key, derived_version, sha256, width, height, error_code,
       created_at, updated_at, claimed_at, claimed_by, finished_at, original_width,
       original_height, original_format, original_frames, original_has_alpha,
       original_colour, original_placeholder, original_dhash, original_media, external_id,
       metadata, (SELECT s.bucket FROM derivd_store AS s) AS bucket
  FROM archive_files WHERE id = %(id)s;

-- name: file_variants
SELECT name, key, version, sha256, width, height, format, content_type, fingerprint, bytes
  FROM archive_variants WHERE file_id = %(id)s ORDER BY name, format;

-- name: file_events
-- `derivd show`: one file's events in order, from every retained day's partition (each
-- found through its (file_id, at) index).
SELECT at, kind, attempt, error_code, actor, lease_token
  FROM archive_events WHERE file_id = %(id)s ORDER BY at, id;

-- name: files_page
-- `derivd files`: files (not re-derivation jobs) newest first, by status, error code,
-- tenant and creation time, one page at a time: `before` is the last id of the page
-- before (keyset paging, stable while rows are added).
SELECT id, status, error_code, tenant, attempts, priority, created_at, finished_at,
       original_key
  FROM archive_files
 WHERE rederive_of IS NULL
   AND (%(status)s::text IS NULL OR status = %(status)s::text)
   AND (%(code)s::text IS NULL OR error_code = %(code)s::text)
   AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s::text)
   AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
   AND (%(until)s::timestamptz IS NULL OR created_at < %(until)s::timestamptz)
   AND (%(before)s::bigint IS NULL OR id < %(before)s::bigint)
 ORDER BY id DESC
 LIMIT %(limit)s;

-- == backfill runs (derivd.queue.backfill_queries) ==

-- name: backfill_page
-- Up to `limit` ready files with id in (after, last], each with its stored variant set
-- (`name.format` -> fingerprint, JSON null for variants made before 0014).
SELECT f.id,
       coalesce(jsonb_object_agg(v.name || '.' || v.format, v.fingerprint)
                    FILTER (WHERE v.name IS NOT NULL), '{}'::jsonb) AS variants
  FROM (SELECT a.id FROM archive_files AS a
         WHERE a.id > %(after)s AND a.id <= %(last)s
           AND a.status = 'ready' AND a.rederive_of IS NULL
         ORDER BY a.id
         LIMIT %(limit)s) AS f
  LEFT JOIN archive_variants AS v ON v.file_id = f.id
 GROUP BY f.id
 ORDER BY f.id;

-- name: backfill_last_id
-- Where a backfill that starts now stops (files made later are made with the new spec).
SELECT coalesce(max(id), 0) AS last_id FROM archive_files;

-- name: backfill_queue
-- Queue re-derivations of these ready files at `priority` for backfill run `run`: one
-- job row each, with the file's original and tenant. A file whose re-derivation is live
-- is skipped; one whose last re-derivation was rejected gets that row queued again (one
-- row per file, however often a backfill finds it). Returns the files queued.
INSERT INTO derivd_rederivations AS q (file_id, backfill, original_key, original_version,
                                       priority, tenant)
SELECT f.id, %(run)s, f.original_key, f.original_version, %(priority)s, f.tenant
  FROM archive_files AS f
 WHERE f.id = ANY(%(ids)s::bigint[]) AND f.status = 'ready'
 ORDER BY f.id
ON CONFLICT (file_id) DO UPDATE
   SET status = 'queued', backfill = EXCLUDED.backfill, attempts = 0, error_code = NULL,
       available_at = now(), original_key = EXCLUDED.original_key,
       original_version = EXCLUDED.original_version, priority = EXCLUDED.priority,
       tenant = EXCLUDED.tenant, ended_token = NULL, finished_at = NULL, updated_at = now()
 WHERE q.status = 'rejected'
RETURNING file_id AS id;

-- name: backfill_claimable
-- Re-derivations waiting to be claimed (--max-queued bounds them).
SELECT count(*)::int AS n FROM derivd_rederivations WHERE status = 'queued';

-- name: backfill_resume
-- The unfinished run toward this target, if any (its cursor is where to resume).
SELECT id, cursor, last_id, scanned, queued
  FROM derivd_backfills
 WHERE target = %(target)s AND finished_at IS NULL
 ORDER BY id DESC
 LIMIT 1;

-- name: backfill_start
-- A new run; unfinished runs toward another target are closed (they can never finish).
WITH closed AS (
    UPDATE derivd_backfills SET finished_at = now(), updated_at = now()
     WHERE finished_at IS NULL
    RETURNING 1
)
INSERT INTO derivd_backfills (target, last_id, configured)
VALUES (%(target)s, %(last_id)s, %(configured)s::jsonb)
RETURNING id, cursor, last_id, scanned, queued;

-- name: backfill_advance
-- After a page is queued: the cursor, durable, so a crash resumes after this page.
UPDATE derivd_backfills
   SET cursor = %(cursor)s, scanned = scanned + %(scanned)s, queued = queued + %(queued)s,
       updated_at = now(), finished_at = CASE WHEN %(done)s THEN now() END
 WHERE id = %(id)s;

-- name: backfill_progress
-- The latest run, the re-derivations still in the queue and those rejected (derivd
-- status, dashboard).
SELECT b.id, b.cursor, b.last_id, b.scanned, b.queued, b.started_at, b.updated_at,
       b.finished_at,
       (SELECT count(*) FROM derivd_rederivations AS q
         WHERE q.status IN ('queued', 'processing'))::int AS in_queue,
       (SELECT count(*) FROM derivd_rederivations AS q
         WHERE q.status = 'rejected')::int AS rejected
  FROM derivd_backfills AS b
 ORDER BY b.id DESC
 LIMIT 1;

-- == the dashboard (derivd.queue.dashboard_queries) ==

-- name: dashboard_in_flight
-- The dashboard's jobs in flight (every host; files and re-derivations), oldest lease
-- first, through the partial indexes on processing rows: bounded by `limit` whatever the
-- tables' size.
SELECT id, attempts, claimed_by,
       extract(epoch FROM now() - claimed_at)::float8 AS age_s,
       extract(epoch FROM lease_until - now())::float8 AS lease_left_s
  FROM (SELECT * FROM (SELECT id, attempts, claimed_by, claimed_at, lease_until
                         FROM archive_files WHERE status = 'processing'
                        ORDER BY lease_until LIMIT %(limit)s) AS files
        UNION ALL
        SELECT * FROM (SELECT id, attempts, claimed_by, claimed_at, lease_until
                         FROM derivd_rederivations WHERE status = 'processing'
                        ORDER BY lease_until LIMIT %(limit)s) AS rederivations) AS p
 ORDER BY lease_until
 LIMIT %(limit)s;

-- name: dashboard_minutes
-- The dashboard's chart: jobs finished (ready, rejected, exhausted events) per minute
-- over the last hour, counted from at most `cap` events, with the median duration (claim
-- to finish) of at most `sample` of each minute's latest jobs
-- (derivd_finished_per_minute in sql/functions.sql): its cost is bounded by the hour's
-- window, not by the table's history.
SELECT minutes_ago, finished, median_s
  FROM derivd_finished_per_minute(%(cap)s::integer, %(sample)s::integer);

-- == derivd.client, on the upload API's connection (derivd.queue.client_queries) ==

-- name: unlisten
UNLISTEN {channel};

-- name: client_enqueue
-- derivd.client.enqueue: one confirmed original (key and version id) becomes `queued`,
-- at a priority (-100..100, higher first) and for a tenant (NULL: none), with the app's
-- external id and metadata (NULL: none; their bounds are the row's rules).
-- The same statement any upload API may run in any language (see the README).
INSERT INTO archive_files (status, original_key, original_version, priority, tenant,
                           external_id, metadata)
VALUES ('queued', %(key)s, %(version)s, %(priority)s, %(tenant)s, %(external_id)s,
        %(metadata)s::jsonb)
RETURNING id;

-- name: store_record
-- `derivd migrate` and every supervisor at start: where the store is (derivd_store).
INSERT INTO derivd_store (backend, bucket) VALUES (%(backend)s, %(bucket)s)
ON CONFLICT (one) DO UPDATE
   SET backend = EXCLUDED.backend, bucket = EXCLUDED.bucket, updated_at = now()
 WHERE (derivd_store.backend, derivd_store.bucket)
       IS DISTINCT FROM (EXCLUDED.backend, EXCLUDED.bucket);

-- name: app_context_problem
-- derivd.client.enqueue and `derivd enqueue`, before they write: the row's own rule.
SELECT derivd_app_context_problem(%(external_id)s::text, %(metadata)s::jsonb) AS problem;

-- name: client_delete
-- derivd.client.delete: the deletion any app calls (derivd_delete_file); NULL: unknown id.
SELECT derivd_delete_file(%(id)s::bigint, %(actor)s::text) AS status;

-- name: wait_register
-- derivd.client.wait, first: the file this waiter waits for, until its deadline. Only
-- registered files are announced on `derivd_finished` (archive_files_notify_finished).
INSERT INTO derivd_waiters (file_id, waiter, until)
VALUES (%(id)s, %(waiter)s, now() + make_interval(secs => %(timeout_s)s::float8));

-- name: wait_unregister
DELETE FROM derivd_waiters WHERE file_id = %(id)s AND waiter = %(waiter)s;

-- name: forget_stale_waiters
-- The sweep: rows of waiters that died without removing theirs (a minute past deadline).
DELETE FROM derivd_waiters WHERE until < now() - interval '1 minute' RETURNING file_id;

-- name: client_status
-- derivd.client.wait: the row's status now (no row: the id is unknown).
SELECT status FROM archive_files WHERE id = %(id)s;

-- name: client_result
-- derivd.client.result: the row (with the app's context and the original's bucket,
-- key and version), every variant (one per variant and format) and the
-- original's analysis; only a ready row's variants and analysis are official (NULL
-- analysis: none, or the handler analysed nothing). No row: unknown id.
SELECT f.status, f.error_code, f.external_id, f.metadata, f.original_key,
       f.original_version, (SELECT s.bucket FROM derivd_store AS s) AS bucket,
       coalesce((SELECT jsonb_agg(jsonb_build_object(
                    'name', v.name, 'key', v.key, 'version', v.version, 'format', v.format,
                    'width', v.width, 'height', v.height, 'bytes', v.bytes,
                    'sha256', v.sha256)
                  ORDER BY v.name, v.format)
                   FROM archive_variants AS v
                  WHERE v.file_id = f.id AND f.status = 'ready'), '[]'::jsonb) AS variants,
       CASE WHEN f.status = 'ready' AND f.original_width IS NOT NULL THEN jsonb_build_object(
           'width', f.original_width, 'height', f.original_height,
           'format', f.original_format, 'frames', f.original_frames,
           'has_alpha', f.original_has_alpha, 'colour', f.original_colour,
           'placeholder', f.original_placeholder, 'dhash', f.original_dhash,
           'media', f.original_media) END AS original
  FROM archive_files AS f
 WHERE f.id = %(id)s;

-- name: similar_distances
-- derivd.client.similar and `derivd similar`: the other ready files within `max` bits of
-- this file's dhash (derivd_similar, in its order: nearest first, at most `limit`; none
-- when it has no dhash or no row has this id), each id with its distance in bits. The
-- function takes the optional band index when it exists.
SELECT s.id, bit_count((f.original_dhash # o.original_dhash)::bit(64))::integer AS distance
  FROM derivd_similar(%(id)s, %(max)s, %(limit)s) WITH ORDINALITY AS s(id, n)
  JOIN archive_files AS f ON f.id = s.id
 CROSS JOIN (SELECT original_dhash FROM archive_files WHERE id = %(id)s) AS o
 ORDER BY s.n;

-- name: webhook_endpoints_sync
-- The supervisor's `[webhook:NAME]` sections, at start, on SIGHUP and every minute: each
-- endpoint's subscription (events, tenants; NULL: every tenant) upserted (one removed
-- before comes back), every other endpoint marked removed. A removed endpoint's
-- undelivered rows end `failed` with "endpoint removed": no host claims them any more
-- (deliveries_claim), and failed they are counted and shown under its name, and
-- replayable once it is configured again; left `pending` they would wait for ever,
-- counted nowhere (retention keeps undelivered rows). A row still leased is left to its
-- POST (delivery_finish ends it `failed` too); a row a commit queued while this ran is
-- ended by the next sync. A removed endpoint's own row goes once it has no undelivered
-- or failed row left (retention or replay took them). The circuit columns are left as
-- they are. Returns the names removed now, the names added or changed, and how many
-- deliveries were ended.
WITH given AS (
    SELECT * FROM jsonb_to_recordset(%(endpoints)s::jsonb)
                  AS g(name text, events text[], tenants text[])
), others AS (
    SELECT e.name, e.removed_at FROM derivd_webhook_endpoints AS e
     WHERE NOT EXISTS (SELECT 1 FROM given AS g WHERE g.name = e.name)
), gone AS (
    UPDATE derivd_webhook_endpoints AS e
       SET removed_at = now(), updated_at = now()
      FROM others AS o
     WHERE e.name = o.name AND o.removed_at IS NULL
    RETURNING e.name
), changed AS (
    INSERT INTO derivd_webhook_endpoints AS e (name, events, tenants)
    SELECT g.name, g.events, g.tenants FROM given AS g
    ON CONFLICT (name) DO UPDATE
       SET events = EXCLUDED.events, tenants = EXCLUDED.tenants, removed_at = NULL,
           updated_at = now()
     WHERE e.events IS DISTINCT FROM EXCLUDED.events
        OR e.tenants IS DISTINCT FROM EXCLUDED.tenants
        OR e.removed_at IS NOT NULL
    RETURNING e.name
), stranded AS (
    UPDATE derivd_deliveries AS d
       SET status = 'failed', lease_token = NULL, lease_until = NULL, finished_at = now(),
           last_error = 'endpoint removed'
      FROM others AS o
     WHERE d.endpoint = o.name
       AND (d.status = 'pending' OR (d.status = 'delivering' AND d.lease_until < now()))
    RETURNING d.id
), emptied AS (
    DELETE FROM derivd_webhook_endpoints AS e
     USING others AS o
     WHERE e.name = o.name AND o.removed_at IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM derivd_deliveries AS d
                        WHERE d.endpoint = e.name AND d.status = 'pending')
       AND NOT EXISTS (SELECT 1 FROM derivd_deliveries AS d
                        WHERE d.endpoint = e.name AND d.status = 'delivering')
       AND NOT EXISTS (SELECT 1 FROM derivd_deliveries AS d
                        WHERE d.endpoint = e.name AND d.status = 'failed')
    RETURNING 1
)
SELECT coalesce((SELECT array_agg(name ORDER BY name) FROM gone), '{}') AS removed,
       coalesce((SELECT array_agg(name ORDER BY name) FROM changed), '{}') AS changed,
       (SELECT count(*) FROM stranded)::int AS stranded,
       (SELECT count(*) FROM emptied)::int AS emptied;

-- name: webhook_endpoints
-- The endpoints the database knows (`derivd webhooks list`), removed ones too.
SELECT name, events, tenants, updated_at, failures, paused_until, last_error, removed_at,
       opened_at, probes
  FROM derivd_webhook_endpoints ORDER BY name;

-- name: deliveries_claim
-- The lease protocol for deliveries: up to `limit` rows of one endpoint, expired leases
-- first (their process died mid-POST), then the due ones oldest first, each locked with
-- SKIP LOCKED and given a fresh token and lease (a delivery is never POSTed by two hosts
-- at once: the lease outlasts the POST's hard timeout). A row waits its turn while an
-- earlier delivery of its file to this endpoint is undelivered (derivd_delivery_waits).
-- The endpoint's circuit, fleet-wide: closed, up to `limit`; open, nothing before
-- paused_until, then one row, the probe, and only by the one claim that locks the
-- endpoint's row while no other probe's lease runs (its token recorded there:
-- delivery_finish tells the probe's end from another's). Nothing once the endpoint is
-- removed (a host whose INI still has it while another's sync removed it posts
-- nothing). age_s: seconds since the event (or its replay), the horizon's clock; all
-- times are the database's. `probe`: this claim is the probe.
WITH circuit AS (
    SELECT e.opened_at IS NOT NULL OR e.removed_at IS NOT NULL
           OR coalesce(e.paused_until > now(), false) AS held
      FROM derivd_webhook_endpoints AS e
     WHERE e.name = %(endpoint)s
), probe AS (
    SELECT e.name FROM derivd_webhook_endpoints AS e
     WHERE e.name = %(endpoint)s AND e.opened_at IS NOT NULL AND e.removed_at IS NULL
       AND coalesce(e.paused_until <= now(), true)  -- NULL: an older host ended the pause
       AND (e.probe_until IS NULL OR e.probe_until < now())
       FOR UPDATE SKIP LOCKED
), gate AS (
    SELECT CASE WHEN EXISTS (SELECT 1 FROM probe) THEN 1
                WHEN EXISTS (SELECT 1 FROM circuit WHERE held) THEN 0
                ELSE %(limit)s::int END AS n
), due AS (
    SELECT * FROM (SELECT d.id FROM derivd_deliveries AS d
                    WHERE d.endpoint = %(endpoint)s AND d.status = 'delivering'
                      AND d.lease_until < now()
                    ORDER BY d.lease_until
                    LIMIT (SELECT n FROM gate)
                      FOR UPDATE OF d SKIP LOCKED) AS expired
    UNION ALL
    SELECT * FROM (SELECT d.id FROM derivd_deliveries AS d
                    WHERE d.endpoint = %(endpoint)s AND d.status = 'pending'
                      AND d.available_at <= now()
                      AND NOT derivd_delivery_waits(d.endpoint, d.file_id, d.id)
                    ORDER BY d.available_at, d.id
                    LIMIT (SELECT n FROM gate)
                      FOR UPDATE OF d SKIP LOCKED) AS pending
    LIMIT (SELECT n FROM gate)
), claimed AS (
    UPDATE derivd_deliveries AS d
       SET status = 'delivering',
           lease_token = gen_random_uuid(),
           lease_until = now() + make_interval(secs => %(lease_s)s),
           attempts = d.attempts + 1,
           claimed_by = %(host)s
      FROM due
     WHERE d.id = due.id
    RETURNING d.id, d.lease_token, d.lease_until, d.attempts, d.event, d.file_id, d.body,
              d.webhook_id, extract(epoch FROM now() - d.retry_from)::float8 AS age_s
), probing AS (
    UPDATE derivd_webhook_endpoints AS e
       SET probe_token = c.lease_token, probe_until = c.lease_until
      FROM probe AS p, (SELECT * FROM claimed LIMIT 1) AS c
     WHERE e.name = p.name
    RETURNING e.name
)
SELECT c.id, c.lease_token, c.attempts, c.event, c.file_id, c.body, c.webhook_id, c.age_s,
       EXISTS (SELECT 1 FROM probing) AS probe
  FROM claimed AS c;

-- name: delivery_finish
-- The fenced end of one attempt (id + token): `delivered`, `failed`, or `pending` again
-- after delay_s; not `pending` again once its endpoint was removed (the sync left this
-- row to its POST): `failed`, "endpoint removed". Zero rows: the lease was lost
-- (another host has it now), nothing changes. The endpoint's circuit, fleet-wide: a
-- success closes it (derivd_circuit_close: an open one lets its backlog flow at once).
-- A failure counts; the `threshold`-th in a row opens it for pause_base seconds; while
-- open, only the probe's failure (its token on the endpoint's row) moves it: the pause
-- doubles with each failed probe, at most pause_max (the POSTs in flight when it opened
-- fail too, and must not grow it). Its row is written only when that changes something
-- (a hot row otherwise). Returns whether the circuit `opened` or `closed` now, and
-- `pause_s`: until its next probe.
WITH ending AS (
    SELECT CASE WHEN %(status)s = 'pending'
                 AND EXISTS (SELECT 1 FROM derivd_deliveries AS d
                               JOIN derivd_webhook_endpoints AS e ON e.name = d.endpoint
                              WHERE d.id = %(id)s AND e.removed_at IS NOT NULL)
                THEN 'failed' ELSE %(status)s::text END AS status
), done AS (
    UPDATE derivd_deliveries AS d
       SET status = n.status,
           available_at = now() + make_interval(secs => %(delay_s)s),
           lease_token = NULL,
           lease_until = NULL,
           finished_at = CASE WHEN n.status IN ('delivered', 'failed') THEN now() END,
           last_status = %(http_status)s,
           last_error = CASE WHEN n.status = %(status)s THEN %(error)s
                             ELSE 'endpoint removed' END
      FROM ending AS n
     WHERE d.id = %(id)s AND d.lease_token = %(token)s  -- the fence
    RETURNING d.endpoint
), failing AS (
    UPDATE derivd_webhook_endpoints AS e
       SET failures = e.failures + 1,
           opened_at = CASE WHEN e.opened_at IS NULL AND e.failures + 1 >= %(threshold)s
                            THEN now() ELSE e.opened_at END,
           probes = CASE WHEN e.opened_at IS NOT NULL AND e.probe_token = %(token)s
                         THEN e.probes + 1 ELSE e.probes END,
           paused_until = CASE
               WHEN e.opened_at IS NULL AND e.failures + 1 >= %(threshold)s
               THEN now() + make_interval(secs => least(%(pause_max)s, %(pause_base)s))
               WHEN e.opened_at IS NOT NULL AND e.probe_token = %(token)s
               THEN now() + make_interval(secs => least(
                        %(pause_max)s::float8,
                        %(pause_base)s * power(2, least(e.probes + 1, 30))))
               ELSE e.paused_until END,
           probe_token = CASE WHEN e.probe_token = %(token)s THEN NULL ELSE e.probe_token END,
           probe_until = CASE WHEN e.probe_token = %(token)s THEN NULL ELSE e.probe_until END,
           last_error = %(error)s,
           last_error_at = now()
      FROM done
     WHERE e.name = done.endpoint AND NOT %(ok)s
    RETURNING e.opened_at = now() AND e.probes = 0 AS opened,
              extract(epoch FROM e.paused_until - now())::float8 AS pause_s
), closing AS (
    SELECT derivd_circuit_close(e.name) AS was_open
      FROM done JOIN derivd_webhook_endpoints AS e ON e.name = done.endpoint
     WHERE %(ok)s AND (e.failures > 0 OR e.opened_at IS NOT NULL OR e.paused_until IS NOT NULL)
)
SELECT (SELECT count(*) FROM done)::int AS finished,
       coalesce((SELECT f.opened FROM failing AS f), false) AS opened,
       coalesce((SELECT c.was_open FROM closing AS c), false) AS closed,
       (SELECT f.pause_s FROM failing AS f) AS pause_s;

-- name: circuit_close
-- `derivd webhooks resume NAME` and a `derivd webhooks test` answered 2xx: the
-- endpoint's circuit closes (derivd_circuit_close). `found`: the database knows it;
-- `was_open`: its circuit was open (its backlog is due now).
SELECT EXISTS (SELECT 1 FROM derivd_webhook_endpoints WHERE name = %(endpoint)s) AS found,
       derivd_circuit_close(%(endpoint)s) AS was_open;

-- name: webhook_stats
-- Per endpoint the database knows: backlog (pending + delivering), the oldest undelivered
-- event's age, deliveries delivered and failed in the last `window_s` seconds, failed
-- rows kept (until replayed or past retention), and the circuit: consecutive failures,
-- paused or not, open or not (and for how long), a probe in flight, seconds to the next
-- probe (NULL: not open; 0: due), failed probes, the last error and its age; `removed`: no longer
-- configured (listed while its failed rows are kept). Bounded by the backlog and the
-- window.
SELECT e.name, e.failures, coalesce(e.paused_until > now(), false) AS paused, e.last_error,
       e.opened_at IS NOT NULL AS open, e.probes,
       extract(epoch FROM now() - e.opened_at)::float8 AS open_age_s,
       coalesce(e.probe_until > now(), false) AS probing,
       CASE WHEN e.opened_at IS NOT NULL OR e.paused_until > now()
            THEN greatest(0, extract(epoch FROM e.paused_until - now()))::float8 END
           AS next_probe_s,
       e.removed_at IS NOT NULL AS removed,
       extract(epoch FROM now() - e.last_error_at)::float8 AS last_error_age_s,
       (SELECT count(*) FROM derivd_deliveries AS d
         WHERE d.endpoint = e.name AND d.status = 'pending')::int
       + (SELECT count(*) FROM derivd_deliveries AS d
           WHERE d.endpoint = e.name AND d.status = 'delivering')::int AS backlog,
       extract(epoch FROM now() - least(
           (SELECT min(d.created_at) FROM derivd_deliveries AS d
             WHERE d.endpoint = e.name AND d.status = 'pending'),
           (SELECT min(d.created_at) FROM derivd_deliveries AS d
             WHERE d.endpoint = e.name AND d.status = 'delivering')))::float8
           AS oldest_undelivered_age_s,
       (SELECT count(*) FROM derivd_deliveries AS d
         WHERE d.endpoint = e.name AND d.status = 'delivered'
           AND d.finished_at >= now() - make_interval(secs => %(window_s)s))::int
           AS delivered_recent,
       (SELECT count(*) FROM derivd_deliveries AS d
         WHERE d.endpoint = e.name AND d.status = 'failed'
           AND d.finished_at >= now() - make_interval(secs => %(window_s)s))::int
           AS failed_recent,
       (SELECT count(*) FROM derivd_deliveries AS d
         WHERE d.endpoint = e.name AND d.status = 'failed')::int AS failed_kept
  FROM derivd_webhook_endpoints AS e
 ORDER BY e.name;

-- name: deliveries_replay
-- `derivd webhooks replay`: finished deliveries (delivered or failed; `failed_only`: the
-- failed ones) of one endpoint or all, of some files or all, of events made in
-- [since, until) or any time, due again now with a fresh horizon and the same
-- webhook-id (receivers that saw one drop it). Wakes the delivering processes. Not the
-- deliveries of a removed endpoint: nobody would deliver them (configure it again first).
WITH done AS (
    UPDATE derivd_deliveries AS d
       SET status = 'pending', available_at = now(), retry_from = now(), finished_at = NULL
     WHERE d.status IN ('delivered', 'failed')
       AND NOT EXISTS (SELECT 1 FROM derivd_webhook_endpoints AS e
                        WHERE e.name = d.endpoint AND e.removed_at IS NOT NULL)
       AND (NOT %(failed_only)s OR d.status = 'failed')
       AND (%(endpoint)s::text IS NULL OR d.endpoint = %(endpoint)s::text)
       AND (%(ids)s::bigint[] IS NULL OR d.file_id = ANY (%(ids)s::bigint[]))
       AND (%(since)s::timestamptz IS NULL OR d.created_at >= %(since)s::timestamptz)
       AND (%(until)s::timestamptz IS NULL OR d.created_at < %(until)s::timestamptz)
    RETURNING d.id
), counted AS (
    SELECT count(*)::int AS replayed FROM done
)
SELECT c.replayed
  FROM counted AS c
  LEFT JOIN LATERAL (SELECT pg_notify('derivd_deliveries', '') WHERE c.replayed > 0) AS w
    ON true;

-- name: deliveries_due_within
-- `run --burst`'s last deliverer, with nothing left to claim: whether one of these
-- endpoints still has a delivery to wait for: one leased (in flight here or on another
-- host; an expired lease is claimable again), or one due within `within_s` seconds whose
-- endpoint's circuit is closed by then, which is not removed and not waiting its turn
-- behind an earlier delivery of its file (that one's own time counts). Through the
-- partial indexes of leased and due rows.
SELECT EXISTS (SELECT 1 FROM derivd_deliveries AS d
                WHERE d.endpoint = ANY (%(endpoints)s::text[]) AND d.status = 'delivering')
    OR EXISTS (SELECT 1 FROM derivd_deliveries AS d
                 LEFT JOIN derivd_webhook_endpoints AS e ON e.name = d.endpoint
                WHERE d.endpoint = ANY (%(endpoints)s::text[]) AND d.status = 'pending'
                  AND d.available_at <= now() + make_interval(secs => %(within_s)s)
                  AND NOT derivd_delivery_waits(d.endpoint, d.file_id, d.id)
                  AND e.removed_at IS NULL
                  AND (e.paused_until IS NULL
                       OR e.paused_until <= now() + make_interval(secs => %(within_s)s)))
       AS waiting;

-- name: deliveries_left
-- What a `run --burst` leaves behind, per endpoint given: undelivered deliveries
-- (pending or leased, each counted to 10,000), seconds until the first pending one is
-- due, and until the endpoint's circuit closes (NULL: closed).
SELECT n.name,
       (SELECT count(*) FROM (SELECT 1 FROM derivd_deliveries AS d
                               WHERE d.endpoint = n.name AND d.status = 'pending'
                               LIMIT 10000) AS q)::int
       + (SELECT count(*) FROM (SELECT 1 FROM derivd_deliveries AS d
                                 WHERE d.endpoint = n.name AND d.status = 'delivering'
                                 LIMIT 10000) AS q)::int AS waiting,
       extract(epoch FROM (SELECT min(d.available_at) FROM derivd_deliveries AS d
                            WHERE d.endpoint = n.name AND d.status = 'pending')
                          - now())::float8 AS next_due_s,
       extract(epoch FROM (SELECT e.paused_until FROM derivd_webhook_endpoints AS e
                            WHERE e.name = n.name AND e.paused_until > now())
                          - now())::float8 AS paused_s
  FROM unnest(%(endpoints)s::text[]) AS n(name)
 ORDER BY n.name;

-- name: delivery_test
-- `derivd webhooks test NAME`: one delivery of a `file.ready`-shaped test event (file id 0,
-- no variants) to that endpoint, through the outbox like any other. Returns its id.
WITH made AS (
    INSERT INTO derivd_deliveries (endpoint, event, file_id, body)
    VALUES (%(endpoint)s, 'file.ready', 0, %(body)s)
    RETURNING id
)
SELECT m.id FROM made AS m
  LEFT JOIN LATERAL (SELECT pg_notify('derivd_deliveries', '')) AS w ON true;

-- name: delivery_row
-- One delivery's state (`derivd webhooks test` waits on it; tests).
SELECT id, endpoint, event, file_id, status, attempts, last_status, last_error
  FROM derivd_deliveries WHERE id = %(id)s;

-- name: deliveries_purge
-- Retention, by the sweep: finished deliveries (delivered, or failed and never replayed)
-- of events older than `days` days, a batch at a time (days = 0: keep them). Pending and
-- delivering rows stay whatever their age. Returns the statuses removed.
DELETE FROM derivd_deliveries
 WHERE id IN (SELECT d.id FROM derivd_deliveries AS d
               WHERE d.created_at < now() - make_interval(days => %(days)s)
                 AND d.status IN ('delivered', 'failed') AND %(days)s > 0
               ORDER BY d.created_at
               LIMIT %(limit)s)
RETURNING status;

-- == cluster administration (the embedded default) (derivd.queue.cluster_admin) ==

-- name: database_exists
-- Cluster administration (the embedded cluster and the test suite): run on the
-- `postgres` maintenance database. `{name}`/`{template}` below are identifiers composed
-- with psycopg.sql.Identifier, never text pasted into the query.
SELECT 1 FROM pg_database WHERE datname = %(name)s;

-- name: create_database
CREATE DATABASE {name};

-- name: create_database_from_template
CREATE DATABASE {name} TEMPLATE {template};

-- name: create_schema
CREATE SCHEMA IF NOT EXISTS {name};

-- name: drop_database
DROP DATABASE IF EXISTS {name} WITH (FORCE);
