-- archive_files' seven CHECKs become one, a call of derivd_file_row_holds (its body,
-- then and now, is in sql/functions.sql; created here too, since the CHECK needs it
-- before functions.sql runs). PostgreSQL reads every CHECK of a table back from its
-- stored text and prepares it again in each statement that writes the table: the claim
-- and the commit paid ~12 % of a job's server CPU for the seven (perf, a noop drain).
-- The rules and the names a broken one reports are unchanged. NOT VALID: the rows there
-- passed the same rules already.
CREATE FUNCTION derivd_file_row_holds(
    status text, error_code text, lease_token uuid, lease_until timestamptz,
    attempts integer, priority smallint, tenant text, original_width integer,
    original_height integer, original_format text, original_frames integer,
    original_has_alpha boolean, original_colour text, original_placeholder text,
    original_dhash bigint)
RETURNS boolean
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    broken text;
BEGIN
    -- Each rule as its CHECK had it (NULL passes, as in a CHECK).
    IF (status::derivd_status IS NOT NULL) IS FALSE THEN
        broken := 'archive_files_status_check';
    ELSIF (error_code IS NULL OR error_code::derivd_error_code IS NOT NULL) IS FALSE THEN
        broken := 'archive_files_error_code_check';
    -- A lease exists exactly while a row is processing: the fence relies on it (a token
    -- match is a status check: derivd_commit_outcomes).
    ELSIF ((status = 'processing') = (lease_token IS NOT NULL AND lease_until IS NOT NULL))
          IS FALSE THEN
        broken := 'archive_files_lease_check';
    ELSIF ((status = 'rejected') = (error_code IS NOT NULL)) IS FALSE THEN
        broken := 'archive_files_rejected_has_code';
    ELSIF (attempts >= 0) IS FALSE THEN
        broken := 'archive_files_attempts_check';
    ELSIF (priority::derivd_priority IS NOT NULL
           AND (tenant IS NULL OR tenant::derivd_tenant IS NOT NULL)) IS FALSE THEN
        broken := 'archive_files_traffic_check';
    -- The analysis: all eight or none. The worker checks the same before it commits
    -- (derivd.analysis_rules): a handler's malformed analysis fails its own job, never
    -- the commit. colour: "#rrggbb", lower case; placeholder: ThumbHash (17-25 bytes)
    -- in base64, padding optional; format: a short lower-case name.
    ELSIF (num_nulls(original_width, original_height, original_format, original_frames,
                     original_has_alpha, original_colour, original_placeholder,
                     original_dhash) = 8
           OR (original_width > 0 AND original_height > 0 AND original_frames > 0
               AND original_format ~ '^[a-z0-9]{1,16}$'
               AND original_has_alpha IS NOT NULL
               AND original_colour ~ '^#[0-9a-f]{6}$'
               AND original_placeholder ~ '^[A-Za-z0-9+/]{16,64}={0,2}$'
               AND original_dhash IS NOT NULL)) IS FALSE THEN
        broken := 'archive_files_original_check';
    ELSE
        RETURN true;
    END IF;
    RAISE EXCEPTION 'new row for relation "archive_files" violates check constraint "%"',
                    broken
          USING ERRCODE = 'check_violation', CONSTRAINT = broken, TABLE = 'archive_files';
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
