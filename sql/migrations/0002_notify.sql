-- Wake idle workers at once: any row entering `queued` (from derivd or from an upload API
-- in any language) notifies one channel. The payload is constant, so PostgreSQL folds the
-- notifications of one transaction into one, and a bulk enqueue costs a single wake-up.
CREATE FUNCTION archive_files_notify_queued() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('derivd_queued', '');
    RETURN NULL;
END $$;

CREATE TRIGGER archive_files_queued_insert AFTER INSERT ON archive_files
    FOR EACH ROW WHEN (NEW.status = 'queued')
    EXECUTE FUNCTION archive_files_notify_queued();

CREATE TRIGGER archive_files_queued_update AFTER UPDATE OF status ON archive_files
    FOR EACH ROW WHEN (NEW.status = 'queued' AND OLD.status IS DISTINCT FROM 'queued')
    EXECUTE FUNCTION archive_files_notify_queued();
