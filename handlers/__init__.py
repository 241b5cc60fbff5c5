"""Image handlers: turn one original (a photo, a PDF's page, a video's frame:
`derivd.handlers.previews`) into the configured variants (WebP, AVIF, JPEG or PNG).

Built in: `vips` (libvips through pyvips), `pillow` and `noop`. Third parties register
more through the `derivd.handlers` entry-point group (see `derivd.handlers.registry`).
"""

from __future__ import annotations
