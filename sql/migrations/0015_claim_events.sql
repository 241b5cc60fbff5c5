-- A capped claim records itself (for the history checker): a `claimed` event with
-- the attempt, its token and the row's tenant, so a history shows every tenant's rows in
-- flight at every claim (harness.invariants.tenants_within_cap replays them). Only the
-- claim under [queue] max_in_flight_per_tenant writes it, where the claim already takes a
-- lock and counts per tenant; the default claim writes nothing more.
--
-- The column is NULL on every other event: nullable, no default, no table rewrite.
ALTER TABLE archive_events ADD COLUMN tenant text;

ALTER DOMAIN derivd_event_kind DROP CONSTRAINT derivd_event_kind_check;
ALTER DOMAIN derivd_event_kind ADD CONSTRAINT derivd_event_kind_check CHECK (VALUE IN (
    'ready', 'retry', 'rejected', 'lease_lost', 'timeout', 'released', 'exhausted',
    'delete_requested', 'deleted', 'operator_retry', 'rederived', 'claimed'));
