-- The claim's queued rows on every turn but the steady one come from derivd_pick_capped,
-- which now checks the attempt cap itself (max_attempts) and rejects a row past it
-- through derivd_file_final. Its signature before that was called by derivd_claim alone,
-- whose new body sql/functions.sql puts in place in this same transaction. IF EXISTS: a
-- database built from nothing runs this before functions.sql has made any function.
DROP FUNCTION IF EXISTS derivd_pick_capped(integer, integer, boolean);
