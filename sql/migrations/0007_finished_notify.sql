-- Tell upload APIs when a file is done: a row reaching a final state (ready, rejected)
-- or leaving the pipeline (deleting, deleted) notifies `derivd_finished` with its id as
-- the payload, and nothing else: the listener reads the row itself (derivd.client.wait),
-- so no data leaves through the channel. Distinct payloads are not folded, so a batch
-- commit sends one notification per row, delivered when the committing transaction ends.
CREATE FUNCTION archive_files_notify_finished() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('derivd_finished', NEW.id::text);
    RETURN NULL;
END $$;

CREATE TRIGGER archive_files_finished_update AFTER UPDATE OF status ON archive_files
    FOR EACH ROW
    WHEN (NEW.status IN ('ready', 'rejected', 'deleting', 'deleted')
          AND OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION archive_files_notify_finished();
