-- Production traffic: a priority and a tenant per file, fair ranks that share
-- the claims between tenants, a fleet-wide share of claims for the oldest work (the
-- starvation bound), and re-derivations of `ready` files that never take them out of
-- `ready` (backfill). docs/traffic.md says why this shape; DESIGN.md is the contract.
--
-- The functions (the claim and commit with the tenant cap and re-derivations, the rank
-- trigger) live in sql/functions.sql, which `derivd migrate` applies right after this.
--
-- Every column is added without rewriting the table (NULL, or a constant default), and
-- every CHECK is NOT VALID: the rows already there hold the defaults, which pass.

-- == Priority and tenant ==============================================================
-- priority: higher runs first, -100..100 (derivd.queue.traffic.PRIORITY_MIN/MAX).
-- tenant: optional, 1..200 characters, no control characters (it is shown by status).
-- fair_rank: given by the trigger below when the row enters `queued`; claim order
-- within a priority. rederive_of: this row re-derives the variants of that (ready) file.
-- The limits as domains (as the vocabularies of 0010): a table CHECK is re-read from its
-- text by every statement that writes the table, claims and commits included; a domain's
-- constraint is compiled once per connection, and the table's one CHECK casts to them.
-- (Domain-typed columns would skip even that, but adding one rewrites the table.)
CREATE DOMAIN derivd_priority AS smallint
    CONSTRAINT derivd_priority_check CHECK (VALUE BETWEEN -100 AND 100);
CREATE DOMAIN derivd_tenant AS text
    CONSTRAINT derivd_tenant_check CHECK (
        char_length(VALUE) BETWEEN 1 AND 200 AND VALUE !~ '[[:cntrl:]]');

ALTER TABLE archive_files
    ADD COLUMN priority    smallint NOT NULL DEFAULT 0,
    ADD COLUMN tenant      text,
    ADD COLUMN fair_rank   bigint,
    ADD COLUMN rederive_of bigint,
    ADD CONSTRAINT archive_files_traffic_check CHECK (
        priority::derivd_priority IS NOT NULL
        AND (tenant IS NULL OR tenant::derivd_tenant IS NOT NULL)) NOT VALID;

-- Rows that are or may come back to `queued` get ranks in their old claim order (due
-- time); a rejected row that an operator retries gets rank 0 then (operator_retry).
UPDATE archive_files AS f
   SET fair_rank = r.n
  FROM (SELECT id, row_number() OVER (ORDER BY available_at, id) AS n
          FROM archive_files WHERE status IN ('pending', 'queued', 'processing')) AS r
 WHERE f.id = r.id;

-- The claim's order: priority, then the fair rank (partial: queued rows only, like
-- archive_files_claimable, which stays for the oldest-first share and the statistics).
CREATE INDEX archive_files_claim_order ON archive_files (priority DESC, fair_rank, id)
    WHERE status = 'queued';
-- A tenant's last rank at a priority: one descent for the rank trigger.
CREATE INDEX archive_files_tenant_rank
    ON archive_files (priority, (coalesce(tenant, '')), fair_rank)
    WHERE status = 'queued';

-- The fair rank of a row entering `queued`: archive_files_fair_rank in sql/functions.sql
-- (applied right after the migrations; created here so that the trigger can name it).
CREATE FUNCTION archive_files_fair_rank() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RETURN NEW;
END $$;

-- On insert only (a pending row gets its rank too, kept when it is queued): a BEFORE
-- UPDATE row trigger makes every UPDATE of the table fetch and lock the old row once
-- more for it (claims and commits included), even with a WHEN that is false.
CREATE TRIGGER archive_files_fair_rank BEFORE INSERT ON archive_files
    FOR EACH ROW WHEN (NEW.fair_rank IS NULL)
    EXECUTE FUNCTION archive_files_fair_rank();

-- The starvation bound: every CLAIM_SHARE-th claim call of the fleet takes the oldest
-- due rows whatever their priority or tenant. A sequence: exact across hosts, no row
-- lock, no WAL per call.
CREATE SEQUENCE derivd_claim_turns CYCLE;

-- == Re-derivations (backfill) ========================================================
-- At most one live re-derivation per file; `derivd delete` finds them here (a finished
-- one has nothing to revoke).
-- (`rederive_of IS NOT NULL` first: no other row enters it, so a claim or an
-- enqueue costs it nothing.)
CREATE UNIQUE INDEX archive_files_rederive_live ON archive_files (rederive_of)
    WHERE rederive_of IS NOT NULL AND status IN ('queued', 'processing');

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
