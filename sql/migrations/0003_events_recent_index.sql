-- `derivd status` and the metrics timer count recent events (`at >= now() - window`).
-- archive_events is append-only and grows with every job, so without an index on `at`
-- that count reads the whole history. Rows arrive in `at` order, which is what a BRIN
-- index needs: a few pages for the whole table and nearly free to maintain on insert.
CREATE INDEX archive_events_at ON archive_events USING brin (at);
