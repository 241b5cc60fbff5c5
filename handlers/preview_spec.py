"""What `[derive]` says about previews of documents and videos (DESIGN.md "Previews").

A module of its own, without imports, so that `base.DeriveSpec` can carry it and the
preview modules (`previews`, `pdf`, `video`) can read it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("image", "pdf", "video")


@dataclass(frozen=True)
class PreviewSpec:
    """Which kinds of original are accepted, and the limits read from a document's or a
    container's header before anything is decoded. `memory_bytes` is what one render may
    allocate (from `[supervisor] max_worker_rss_mb`; 0: no bound beyond `max_pixels`)."""

    accept: frozenset[str] = frozenset(KINDS)
    max_pages: int = 10_000
    max_duration_s: float = 3 * 3600.0
    max_streams: int = 32
    frame_offset: float = 0.1  # where the frame is looked for, as a fraction of the duration
    pdf_page: int = 1  # 1-based; a shorter document previews its last page
    memory_bytes: int = 0
