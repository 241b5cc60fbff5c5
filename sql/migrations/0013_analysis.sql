-- The analysis of the original (DESIGN.md "Analysis"), stored on its row by the fenced
-- commit: what an app needs when a file becomes `ready` (the displayed size to reserve
-- layout space, a placeholder to paint before the variants load, a representative colour)
-- and a perceptual hash to spot re-uploads (derivd.client.similar).
--
-- `original_` like original_key: they describe the original, while width/height (0001)
-- describe the primary variant. All eight are set together or not at all: a handler that
-- analyses nothing (noop, a third-party one returning a plain list) commits NULLs.
--
-- Plain types and one NOT VALID CHECK, so that this migration neither rewrites nor scans
-- archive_files (the fleet's history) under its ACCESS EXCLUSIVE lock: a column of a domain
-- type with a constraint makes PostgreSQL 15 rewrite the table on ADD COLUMN, and a CHECK
-- added VALID scans it. Every row has NULLs here, which the CHECK accepts. The worker
-- checks the same rules before it commits (derivd.analysis), so a handler's malformed
-- analysis is its job's `processing_failed`, never a failed commit statement.
--
-- The commit that stores the analysis (derivd_commit_and_claim) and derivd_similar, the
-- near-duplicate search, live in sql/functions.sql.
--   colour       "#rrggbb", lower-case hex, sRGB
--   placeholder  ThumbHash bytes in base64: 17-25 bytes are 24-36 characters (padding
--                optional); the bound keeps a handler from bloating an update-heavy row
--   format       a short lower-case name (jpeg, png, gif, webp, tiff, avif, heic, ...)
--   dhash        64-bit difference hash as a signed bigint (any value)
ALTER TABLE archive_files
    ADD COLUMN original_width       integer,
    ADD COLUMN original_height      integer,
    ADD COLUMN original_format      text,
    ADD COLUMN original_frames      integer,
    ADD COLUMN original_has_alpha   boolean,
    ADD COLUMN original_colour      text,
    ADD COLUMN original_placeholder text,
    ADD COLUMN original_dhash       bigint,
    ADD CONSTRAINT archive_files_original_check CHECK (
        num_nulls(original_width, original_height, original_format, original_frames,
                  original_has_alpha, original_colour, original_placeholder,
                  original_dhash) = 8
        OR (original_width > 0 AND original_height > 0 AND original_frames > 0
            AND original_format ~ '^[a-z0-9]{1,16}$'
            AND original_has_alpha IS NOT NULL
            AND original_colour ~ '^#[0-9a-f]{6}$'
            AND original_placeholder ~ '^[A-Za-z0-9+/]{16,64}={0,2}$'
            AND original_dhash IS NOT NULL)) NOT VALID;
