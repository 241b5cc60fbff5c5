"""What an ISO-BMFF movie (MP4, MOV) declares in its `moov` box, read before any demuxer.

The limits and the refusals a video needs before ffmpeg's libraries see its bytes: the
frame size each video track declares (`tkhd`, 16.16 fixed point, and its sample entry's
16-bit width and height: a `moov` may claim 65535 x 65535 while its first frame is small),
the movie's duration (`mvhd`), how many tracks it has, how many samples a track
declares (`stsz`: ffmpeg builds an index entry for each), and whether a track is encrypted
(CENC and its `cbcs` pattern store `encv`/`enca` sample entries with a `sinf` box:
ffmpeg would decode such samples into garbage without a key). Box headers only, through
`isobmff`'s walker; damaged boxes give what could be read.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from derivd.handlers.isobmff import _boxes, _child, _samples

_FULL_BOX = 4
_ENCRYPTED_ENTRIES = frozenset({b"encv", b"enca", b"enct", b"encs"})
# A visual sample entry: 6 reserved bytes, data_reference_index (2), 16 bytes of
# pre-defined and reserved fields, then width and height (16 bits each).
_VISUAL_SIZE_AT = 24


@dataclass(frozen=True)
class Movie:
    """The `moov` box's facts: tracks, the largest declared frame (width, height), the
    duration in seconds (None when not declared) and whether any track is encrypted."""

    tracks: int = 0
    frame: tuple[int, int] = (0, 0)
    duration_s: float | None = None
    encrypted: bool = False
    samples: int = 0  # the most any track's `stsz` declares


def declared_movie(data: bytes) -> Movie:
    """The facts of the first `moov` box (an empty Movie when there is none)."""
    moov = _child(data, 0, len(data), b"moov")
    if moov is None:
        return Movie()
    tracks, width, height, encrypted = 0, 0, 0, False
    for kind, lo, hi in _boxes(data, *moov):
        if kind != b"trak":
            continue
        tracks += 1
        tkhd = _child(data, lo, hi, b"tkhd")
        if tkhd is not None:
            w, h = _tkhd_size(data, *tkhd)
            width, height = max(width, w), max(height, h)
        for entry, e_lo, e_hi in _sample_entries(data, lo, hi):
            encrypted = encrypted or entry in _ENCRYPTED_ENTRIES
            if e_hi - e_lo >= _VISUAL_SIZE_AT + 4 and _is_video_track(data, lo, hi):
                w, h = struct.unpack(">HH", data[e_lo + 24 : e_lo + 28])
                width, height = max(width, w), max(height, h)
    samples = _samples(data, *moov)
    return Movie(tracks, (width, height), _duration(data, *moov), encrypted, samples)


def _tkhd_size(data: bytes, lo: int, hi: int) -> tuple[int, int]:
    """A track header's width and height (16.16 fixed point: the whole part)."""
    version = data[lo] if lo < hi else 0
    at = lo + _FULL_BOX + (32 if version == 1 else 20) + 52  # to `width`
    if at + 8 > hi:
        return 0, 0
    width, height = struct.unpack(">II", data[at : at + 8])
    return width >> 16, height >> 16


def _is_video_track(data: bytes, lo: int, hi: int) -> bool:
    mdia = _child(data, lo, hi, b"mdia")
    hdlr = _child(data, *mdia, b"hdlr") if mdia else None
    return hdlr is not None and data[hdlr[0] + 8 : hdlr[0] + 12] == b"vide"


def _sample_entries(data: bytes, lo: int, hi: int) -> list[tuple[bytes, int, int]]:
    """(type, payload start, payload end) of a track's `stsd` entries."""
    found: tuple[int, int] | None = (lo, hi)
    for kind in (b"mdia", b"minf", b"stbl", b"stsd"):
        found = _child(data, *found, kind) if found else None
    if found is None or found[1] - found[0] < _FULL_BOX + 4:
        return []
    return list(_boxes(data, found[0] + _FULL_BOX + 4, found[1]))


def _duration(data: bytes, lo: int, hi: int) -> float | None:
    mvhd = _child(data, lo, hi, b"mvhd")
    if mvhd is None:
        return None
    at, end = mvhd
    if end - at < _FULL_BOX + 28:
        return None
    if data[at] == 1:  # 64-bit times
        timescale, duration = struct.unpack(">IQ", data[at + 20 : at + 32])
    else:
        timescale, duration = struct.unpack(">II", data[at + 12 : at + 20])
    if timescale == 0 or duration in (0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF):
        return None  # "unknown" in the box's own words
    return float(duration / timescale)
