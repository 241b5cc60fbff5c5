"""Image handlers: turn one original into the configured WebP variants.

Built in: `vips` (libvips through pyvips), `pillow` and `noop`. Third parties register
more through the `derivd.handlers` entry-point group (see `derivd.handlers.registry`).
"""

from __future__ import annotations
