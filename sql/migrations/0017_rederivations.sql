-- Re-derivations in a table of their own. A re-derivation was a
-- row of archive_files (rederive_of set): every count, the rejected share and any app's
-- query over archive_files took it for a file, a file that kept failing got another
-- rejected row per backfill, and `derivd retry --rejected` died on the unique index of
-- live ones. docs/traffic.md says why this shape.
--
-- The functions (the claim's top-up from this table, the commit's swap, the failure and
-- release fences, the heartbeat) live in sql/functions.sql, applied right after this.

-- One row per file at most: its live re-derivation, or the one that was rejected (a new
-- backfill queues that row again). A swapped-in one is deleted by its commit. Ids come
-- from archive_files' sequence: a job id is never a file id, so a worker, its
-- supervisor and the events name either without saying which. No foreign key to the
-- file: it would add a trigger check to every UPDATE of archive_files (claims and
-- commits); `derivd delete` removes a file's job row itself (request_delete).
CREATE TABLE derivd_rederivations (
    id               bigint      PRIMARY KEY DEFAULT nextval('archive_files_id_seq'),
    file_id          bigint      NOT NULL,
    -- The run that queued it: its configured set is the only one the swap takes.
    backfill         bigint      REFERENCES derivd_backfills (id) ON DELETE SET NULL,
    status           text        NOT NULL DEFAULT 'queued',
    attempts         integer     NOT NULL DEFAULT 0,
    available_at     timestamptz NOT NULL DEFAULT now(),
    lease_token      uuid,
    lease_until      timestamptz,
    original_key     text        NOT NULL,
    original_version text,
    priority         smallint    NOT NULL DEFAULT 0,
    tenant           text,
    error_code       text,
    -- The token of the attempt whose own failure or release ended the last lease: the
    -- heartbeat's proof that a job which left `processing` was not lost.
    ended_token      uuid,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    claimed_at       timestamptz,
    claimed_by       text,
    finished_at      timestamptz,
    CONSTRAINT derivd_rederivations_status_check
        CHECK (status IN ('queued', 'processing', 'rejected')),
    CONSTRAINT derivd_rederivations_error_code_check
        CHECK (error_code IS NULL OR error_code::derivd_error_code IS NOT NULL),
    CONSTRAINT derivd_rederivations_lease_check CHECK (
        (status = 'processing') = (lease_token IS NOT NULL AND lease_until IS NOT NULL)),
    CONSTRAINT derivd_rederivations_rejected_has_code CHECK (
        (status = 'rejected') = (error_code IS NOT NULL)),
    CONSTRAINT derivd_rederivations_attempts_check CHECK (attempts >= 0),
    CONSTRAINT derivd_rederivations_traffic_check CHECK (
        priority::derivd_priority IS NOT NULL
        AND (tenant IS NULL OR tenant::derivd_tenant IS NOT NULL))
);
CREATE UNIQUE INDEX derivd_rederivations_file ON derivd_rederivations (file_id);
CREATE INDEX derivd_rederivations_claim_order ON derivd_rederivations (priority DESC, id)
    WHERE status = 'queued';
CREATE INDEX derivd_rederivations_claimable ON derivd_rederivations (available_at, id)
    WHERE status = 'queued';
CREATE INDEX derivd_rederivations_leased ON derivd_rederivations (lease_until)
    WHERE status = 'processing';

-- The set a run aims at (slot -> fingerprint, derivd.fingerprint.configured_set).
ALTER TABLE derivd_backfills ADD COLUMN configured jsonb;

-- The job rows move, ids, tokens and leases kept (an attempt under way still commits):
-- per file its live one, else its latest rejected one. Finished and deleted ones go.
INSERT INTO derivd_rederivations (id, file_id, status, attempts, available_at, lease_token,
                                  lease_until, original_key, original_version, priority,
                                  tenant, error_code, created_at, updated_at, claimed_at,
                                  claimed_by, finished_at)
SELECT DISTINCT ON (j.rederive_of)
       j.id, j.rederive_of, j.status, j.attempts, j.available_at, j.lease_token,
       j.lease_until, j.original_key, j.original_version, j.priority, j.tenant,
       j.error_code, j.created_at, j.updated_at, j.claimed_at, j.claimed_by, j.finished_at
  FROM archive_files AS j
  JOIN archive_files AS f ON f.id = j.rederive_of AND f.status = 'ready'
 WHERE j.rederive_of IS NOT NULL AND j.status IN ('queued', 'processing', 'rejected')
 ORDER BY j.rederive_of, j.status = 'rejected', j.id DESC;
DELETE FROM archive_files WHERE rederive_of IS NOT NULL;

-- `rederive_rejected`: on the file, when its re-derivation was rejected (the file keeps
-- its set; not a file's rejection, so not in the rejected share).
ALTER DOMAIN derivd_event_kind DROP CONSTRAINT derivd_event_kind_check;
ALTER DOMAIN derivd_event_kind ADD CONSTRAINT derivd_event_kind_check CHECK (VALUE IN (
    'ready', 'retry', 'rejected', 'lease_lost', 'timeout', 'released', 'exhausted',
    'delete_requested', 'deleted', 'operator_retry', 'rederived', 'claimed', 'worker_died',
    'rederive_rejected'));
