-- Signed webhooks: the endpoints the supervisors subscribe and the outbox
-- of deliveries. The functions that fill it (derivd_outbox, called by the commit, the
-- failure, the rejections and deletions) and the delivery protocol live in
-- sql/functions.sql, applied right after this. New tables only: nothing is rewritten.

-- The transactional outbox: the statement that makes a file ready, rejected, re-derived
-- or deleted inserts one delivery per subscribed endpoint (derivd_outbox in
-- functions.sql), in its own transaction. The endpoints are each supervisor's
-- `[webhook:NAME]` sections, kept here by the supervisors (at start and SIGHUP): the
-- database itself knows who subscribes to what, so every derivd statement that ends a
-- file (a worker's commit or failure, the supervisor's rejections, the sweep's deletions,
-- a host of the previous release calling the same functions) fills the outbox with no
-- argument to carry. (A hand-written UPDATE of archive_files announces nothing.) Secrets
-- and URLs never come here: each host signs and POSTs with its own configuration.
CREATE DOMAIN derivd_webhook_event AS text CONSTRAINT derivd_webhook_event_check CHECK (
    VALUE IN ('file.ready', 'file.rejected', 'file.rederived', 'file.deleted'));

-- One row per endpoint: its subscription, and the circuit the delivering processes of
-- every host share (consecutive failures; no claims before paused_until).
CREATE TABLE derivd_webhook_endpoints (
    name          text        PRIMARY KEY,
    events        text[]      NOT NULL,
    tenants       text[],
    updated_at    timestamptz NOT NULL DEFAULT now(),
    failures      integer     NOT NULL DEFAULT 0,
    paused_until  timestamptz,
    last_error    text,
    last_error_at timestamptz
);

-- One row per event and endpoint, delivered under the lease protocol: `pending` (due at
-- available_at) -> `delivering` (leased: token + lease_until, claimed by a host) ->
-- `delivered`, back to `pending` with backoff, or `failed` past the endpoint's horizon
-- (counted from retry_from: the event, or its replay). The id is the webhook-id
-- (`msg_<id>`): the same on every retry. `body` is the exact text POSTed and signed.
-- last_error: one safe line ("http 500", "timeout"), never a response's text.
CREATE TABLE derivd_deliveries (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    endpoint     text        NOT NULL,
    event        text        NOT NULL,
    file_id      bigint      NOT NULL,
    body         text        NOT NULL,
    status       text        NOT NULL DEFAULT 'pending',
    attempts     integer     NOT NULL DEFAULT 0,
    created_at   timestamptz NOT NULL DEFAULT now(),
    retry_from   timestamptz NOT NULL DEFAULT now(),
    available_at timestamptz NOT NULL DEFAULT now(),
    lease_token  uuid,
    lease_until  timestamptz,
    claimed_by   text,
    finished_at  timestamptz,
    last_status  integer,
    last_error   text,
    CONSTRAINT derivd_deliveries_status_check
        CHECK (status IN ('pending', 'delivering', 'delivered', 'failed')),
    CONSTRAINT derivd_deliveries_event_check CHECK (event::derivd_webhook_event IS NOT NULL),
    CONSTRAINT derivd_deliveries_lease_check CHECK (
        (status = 'delivering') = (lease_token IS NOT NULL AND lease_until IS NOT NULL))
);
-- Due rows per endpoint, leased rows (an expired lease is claimable again), finished rows
-- per endpoint by age (the last hour's counts, retention), and one file's (replay).
CREATE INDEX derivd_deliveries_due ON derivd_deliveries (endpoint, available_at)
    WHERE status = 'pending';
CREATE INDEX derivd_deliveries_leased ON derivd_deliveries (endpoint, lease_until)
    WHERE status = 'delivering';
CREATE INDEX derivd_deliveries_finished ON derivd_deliveries (endpoint, status, finished_at)
    WHERE status IN ('delivered', 'failed');
CREATE INDEX derivd_deliveries_file ON derivd_deliveries (file_id);
CREATE INDEX derivd_deliveries_created ON derivd_deliveries (created_at);
