-- A new error code, `missing_original`: the original cannot be read, for good (no such
-- key, no such version, or a key the store refuses). Until now such a row either ended
-- `processing_failed` at once (a missing object) or was retried as an outage until its
-- attempts ran out (a key the store refuses): an operator could not tell "the upload API
-- queued something that is not there" from "the backend is broken".
--
-- Only the domain changes: no column has the domain's type (the table CHECKs of 0010
-- cast to it), so replacing its constraint reads no row and is instant. Hosts of the
-- previous release never write the new code.
ALTER DOMAIN derivd_error_code DROP CONSTRAINT derivd_error_code_check;
ALTER DOMAIN derivd_error_code ADD CONSTRAINT derivd_error_code_check CHECK (VALUE IN (
    'unsupported_content', 'corrupt_content', 'resource_limit', 'missing_original',
    'attempts_exhausted', 'processing_failed'));

