-- A variant may be stored in several formats (`format = avif, webp`): one row per variant
-- and format, each with the Content-Type it was PUT with. Rows written before this
-- migration are WebP. Adding a column with a constant default rewrites nothing; the
-- defaults are dropped afterwards so every new row states its format.
ALTER TABLE archive_variants
    ADD COLUMN format       text NOT NULL DEFAULT 'webp',
    ADD COLUMN content_type text NOT NULL DEFAULT 'image/webp';
ALTER TABLE archive_variants
    ALTER COLUMN format DROP DEFAULT,
    ALTER COLUMN content_type DROP DEFAULT,
    ADD CONSTRAINT archive_variants_format_check
        CHECK (format IN ('webp', 'avif', 'jpeg', 'png')),
    DROP CONSTRAINT archive_variants_pkey,
    ADD PRIMARY KEY (file_id, name, format);
