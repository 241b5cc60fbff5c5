"""The one still picture a PDF or a video is previewed from (`derivd.handlers.previews`):
what `pdf` and `video` hand both backends, in a module of its own so that neither
imports the dispatcher that imports them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Preview:
    """One still picture of a document or a video, and what its header said.

    `pixels`: 8-bit RGB, packed rows, `size` pixels, upright. `upright`: the size the
    variants are derived from (`geometry.base_size` of it is at most `size`, give or take
    rounding); `shown`: the width and height the analysis reports (a PDF page in points,
    a video frame as displayed)."""

    pixels: bytes
    size: tuple[int, int]
    upright: tuple[int, int]
    shown: tuple[int, int]
    format: str  # pdf, mp4, mov, webm, mkv
    frames: int  # a PDF's pages, a video's frames
    media: dict[str, Any]
