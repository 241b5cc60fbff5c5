-- `worker_died`: a supervisor saw the worker holding this attempt die (a crash, kill -9,
-- the OOM killer) and returned the job at once (derivd_worker_died in functions.sql)
-- instead of leaving it to wait out its lease.
ALTER DOMAIN derivd_event_kind DROP CONSTRAINT derivd_event_kind_check;
ALTER DOMAIN derivd_event_kind ADD CONSTRAINT derivd_event_kind_check CHECK (VALUE IN (
    'ready', 'retry', 'rejected', 'lease_lost', 'timeout', 'released', 'exhausted',
    'delete_requested', 'deleted', 'operator_retry', 'rederived', 'claimed', 'worker_died'));
