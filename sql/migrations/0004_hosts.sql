-- The host registry (one row per supervisor, named by its [supervisor] host_id) and the
-- holder of each claim. A supervisor registers at start, refreshes its row with every
-- heartbeat (database time), and deletes it on a clean stop; a host whose heartbeat is
-- three intervals old is stale, and stale rows are pruned after the [sweep] guard.
CREATE TABLE derivd_hosts (
    host           text             PRIMARY KEY,
    pid            integer          NOT NULL,
    version        text             NOT NULL,
    backend        text             NOT NULL,
    workers        integer          NOT NULL,
    busy           integer          NOT NULL,
    heartbeat_s    double precision NOT NULL,
    started_at     timestamptz      NOT NULL DEFAULT now(),
    last_heartbeat timestamptz      NOT NULL DEFAULT now(),
    CONSTRAINT derivd_hosts_host_check CHECK (
        octet_length(host) BETWEEN 1 AND 200 AND host !~ '[[:cntrl:]]'),
    CONSTRAINT derivd_hosts_heartbeat_check CHECK (heartbeat_s > 0)
);

-- Who holds (or last held) each claim: `derivd status` counts a host's jobs in flight
-- through the partial index of processing rows. Nullable, no default: adding it rewrites
-- nothing.
ALTER TABLE archive_files ADD COLUMN claimed_by text;
