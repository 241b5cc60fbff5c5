-- archive_files' row check takes the whole row instead of its fifteen columns (the rules
-- and the names a broken one reports are unchanged). PostgreSQL reads a table's CHECK
-- back from its stored text and prepares it again in every statement that writes the
-- table, and each column reference is a long node in that text: the fifteen cost ~3 %
-- of a noop job's server instructions, a claim's UPDATE and a commit's (callgrind,
-- bench/RESULTS.md, 2026-12-03). NOT VALID: the rows there passed the same rules.
-- A placeholder until sql/functions.sql, which `migrate` runs next in the same
-- transaction, gives it its body (the one copy of the rules): no row is written between.
CREATE FUNCTION derivd_file_row_holds(r record)
RETURNS boolean
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    RETURN true;
END $$;

ALTER TABLE archive_files
    DROP CONSTRAINT archive_files_row_check,
    ADD CONSTRAINT archive_files_row_check CHECK (derivd_file_row_holds(archive_files))
        NOT VALID;

-- Called by the old CHECK alone.
DROP FUNCTION derivd_file_row_holds(text, text, uuid, timestamptz, integer, smallint, text,
                                    integer, integer, text, integer, boolean, text, text,
                                    bigint);
