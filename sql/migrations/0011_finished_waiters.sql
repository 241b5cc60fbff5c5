-- Announce a finished file on `derivd_finished` only when someone waits for it.
--
-- Why: a transaction that has sent a NOTIFY takes a lock on the whole PostgreSQL
-- instance when it commits and holds it until its commit is on disk (PreCommit_Notify:
-- "serialize writers ... till after commit", so that notifications appear in commit
-- order). 0007 notified every finished row, so every job's commit waited for every other
-- job's commit, fleet-wide, WAL flush included: one NOTIFY per job caps a database at one
-- commit per flush, whatever its cores. Most upload APIs answer 202 and never wait; the
-- ones that do (derivd.client.wait, or the same SQL in any language: README) register the
-- file they wait for here, and only those files are announced. The announcement is the
-- same: sent by the transaction that finishes the row, payload the id only.
--
-- UNLOGGED: a waiter lives as long as its connection, which a server crash ends anyway;
-- registering costs no WAL. A waiter removes its row when it stops waiting; `until`
-- (its deadline) lets the sweep forget the rows of waiters that died.
CREATE UNLOGGED TABLE derivd_waiters (
    file_id bigint      NOT NULL,
    waiter  uuid        NOT NULL,
    until   timestamptz NOT NULL,
    PRIMARY KEY (file_id, waiter)
);

CREATE OR REPLACE FUNCTION archive_files_notify_finished() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM derivd_waiters AS w WHERE w.file_id = NEW.id) THEN
        PERFORM pg_notify('derivd_finished', NEW.id::text);
    END IF;
    RETURN NULL;
END $$;
