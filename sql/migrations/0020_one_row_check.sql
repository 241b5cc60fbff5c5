-- archive_files' seven CHECKs become one, a call of derivd_file_row_holds (its body is
-- in sql/functions.sql; declared here, since the CHECK needs it before functions.sql
-- runs). PostgreSQL reads every CHECK of a table back from its
-- stored text and prepares it again in each statement that writes the table: the claim
-- and the commit paid ~12 % of a job's server CPU for the seven (perf, a noop drain).
-- The rules and the names a broken one reports are unchanged. NOT VALID: the rows there
-- passed the same rules already.
-- A placeholder until sql/functions.sql, which `migrate` runs next in the same
-- transaction, gives it its body (the one copy of the rules): no row is written between.
CREATE FUNCTION derivd_file_row_holds(
    status text, error_code text, lease_token uuid, lease_until timestamptz,
    attempts integer, priority smallint, tenant text, original_width integer,
    original_height integer, original_format text, original_frames integer,
    original_has_alpha boolean, original_colour text, original_placeholder text,
    original_dhash bigint)
RETURNS boolean
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    RETURN true;
END $$;

ALTER TABLE archive_files
    DROP CONSTRAINT archive_files_status_check,
    DROP CONSTRAINT archive_files_error_code_check,
    DROP CONSTRAINT archive_files_lease_check,
    DROP CONSTRAINT archive_files_rejected_has_code,
    DROP CONSTRAINT archive_files_attempts_check,
    DROP CONSTRAINT archive_files_original_check,
    DROP CONSTRAINT archive_files_traffic_check,
    ADD CONSTRAINT archive_files_row_check CHECK (derivd_file_row_holds(
        status, error_code, lease_token, lease_until, attempts, priority, tenant,
        original_width, original_height, original_format, original_frames,
        original_has_alpha, original_colour, original_placeholder, original_dhash))
        NOT VALID;
