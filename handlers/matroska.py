"""What a Matroska or WebM file declares in its `Tracks` element, read before any demuxer:
whether a track is encrypted (WebM encryption: a `ContentEncryption` in the track's
`ContentEncodings`; ffmpeg would hand on the encrypted frames, which decode to garbage
without the key).

EBML (RFC 8794): each element is an ID and a size, both variable-length integers (the
ID keeps its length marker, the size drops it; a size of all ones is "unknown": to the
end of the parent). Element headers only; damaged ones give what could be read.
"""

from __future__ import annotations

from collections.abc import Iterator

EBML_MAGIC = b"\x1a\x45\xdf\xa3"  # the EBML header's ID: a Matroska or WebM file's first bytes
SEGMENT = 0x18538067
TRACKS = 0x1654AE6B
TRACK_ENTRY = 0xAE
CONTENT_ENCODINGS = 0x6D80
CONTENT_ENCODING = 0x6240
CONTENT_ENCRYPTION = 0x5035
CLUSTER = 0x1F43B675  # the media data: the header elements come before it


def _vint(data: bytes, at: int, keep_marker: bool) -> tuple[int, int] | None:
    """(value, length) of the variable-length integer at `at`, or None."""
    if at >= len(data) or data[at] == 0:
        return None
    length = 9 - data[at].bit_length()  # the leading zeros, plus the marker bit
    if at + length > len(data):
        return None
    value = int.from_bytes(data[at : at + length], "big")
    if not keep_marker:
        value &= (1 << (7 * length)) - 1
        if value == (1 << (7 * length)) - 1:
            value = -1  # unknown size
    return value, length


def elements(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(ID, payload start, payload end) of each element in data[start:end]."""
    at = start
    while at < end:
        ident = _vint(data, at, keep_marker=True)
        size = _vint(data, at + ident[1], keep_marker=False) if ident else None
        if ident is None or size is None:
            return
        payload = at + ident[1] + size[1]
        stop = end if size[0] < 0 else min(end, payload + size[0])
        yield ident[0], payload, stop
        at = stop


def _child(data: bytes, start: int, end: int, wanted: int) -> Iterator[tuple[int, int]]:
    for ident, lo, hi in elements(data, start, end):
        if ident == wanted:
            yield lo, hi


def encrypted(data: bytes) -> bool:
    """Whether any track of the first segment declares a ContentEncryption."""
    for segment in _child(data, 0, len(data), SEGMENT):
        for ident, lo, hi in elements(data, *segment):
            if ident == CLUSTER:
                return False
            if ident == TRACKS and _any_encrypted(data, lo, hi):
                return True
        return False
    return False


def _any_encrypted(data: bytes, lo: int, hi: int) -> bool:
    for entry in _child(data, lo, hi, TRACK_ENTRY):
        for encodings in _child(data, *entry, CONTENT_ENCODINGS):
            for encoding in _child(data, *encodings, CONTENT_ENCODING):
                if any(True for _ in _child(data, *encoding, CONTENT_ENCRYPTION)):
                    return True
    return False
