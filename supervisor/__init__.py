"""derivd: a prefork daemon that derives WebP images from uploaded originals."""

from __future__ import annotations

__version__ = "0.1.0"
