"""derivd: a prefork daemon that derives image variants (WebP, AVIF, JPEG, PNG) from
uploaded originals."""

from __future__ import annotations

__version__ = "0.1.0"
