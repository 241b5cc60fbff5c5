"""What a HEIF file (HEIC, AVIF) declares about its work, read from its boxes alone.

The limits need two numbers libheif does not hand out before it decodes: how many tiles
the primary image is made of (a grid of thousands of tiles is thousands of HEVC decodes,
though its pixel count may be modest) and how many samples an image sequence holds (a
burst stored as a track rather than as items); and, for AVIF on Pillow, the primary
image's size before libavif refuses an oversized one in words Pillow reports as "cannot
identify". Everything here reads box headers only;
damaged boxes give what could be read and the decoder reports the damage itself.

ISO/IEC 14496-12 (the box format) and 23008-12 (HEIF): `meta` holds `pitm` (the primary
item), `iinf` (item types) and `iref` (`dimg`: a derived image's inputs, i.e. a grid's
tiles); `moov/trak/mdia/minf/stbl/stsz` counts a track's samples.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

_FULL_BOX = 4  # version (1 byte) and flags (3 bytes) before a full box's fields
_CONTAINERS = (b"moov", b"trak", b"mdia", b"minf", b"stbl")


@dataclass(frozen=True)
class Declared:
    """The primary item's tile count (1 for a plain coded image), its stored size (`ispe`,
    before any rotation; None when not found), the largest number of samples any track
    declares (0 without tracks) and the codec of its pixels."""

    tiles: int
    samples: int
    size: tuple[int, int] | None = None
    # The coding of the primary's pixels: its item type (`hvc1`, `av01`, `unci`, ...),
    # or, for a derived image (a grid), its first input's. None when not found.
    codec: bytes | None = None


def _boxes(data: bytes, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    """(type, payload start, payload end) of each box in data[start:end]."""
    at = start
    while at + 8 <= end:
        size, kind = struct.unpack(">I4s", data[at : at + 8])
        header = 8
        if size == 1:  # a 64-bit size follows the type
            if at + 16 > end:
                return
            (size,) = struct.unpack(">Q", data[at + 8 : at + 16])
            header = 16
        elif size == 0:  # to the end of the enclosing box
            size = end - at
        if size < header or at + size > end:
            return
        yield kind, at + header, at + size
        at += size


def _child(data: bytes, start: int, end: int, kind: bytes) -> tuple[int, int] | None:
    for found, lo, hi in _boxes(data, start, end):
        if found == kind:
            return lo, hi
    return None


def _primary(data: bytes, meta: tuple[int, int]) -> int | None:
    pitm = _child(data, *meta, b"pitm")
    if pitm is None or pitm[1] - pitm[0] < _FULL_BOX + 2:
        return None
    lo = pitm[0]
    if data[lo] == 0:
        return int(struct.unpack(">H", data[lo + 4 : lo + 6])[0])
    return int(struct.unpack(">I", data[lo + 4 : lo + 8])[0]) if pitm[1] - lo >= 8 else None


def _item_types(data: bytes, meta: tuple[int, int]) -> dict[int, bytes]:
    """Item id -> item type, from the `infe` entries (versions 2 and 3) of `iinf`."""
    iinf = _child(data, *meta, b"iinf")
    if iinf is None or iinf[1] - iinf[0] < _FULL_BOX + 2:
        return {}
    start = iinf[0] + _FULL_BOX + (2 if data[iinf[0]] == 0 else 4)
    types: dict[int, bytes] = {}
    for kind, lo, hi in _boxes(data, start, iinf[1]):
        if kind != b"infe" or hi - lo < _FULL_BOX + 8:
            continue
        version = data[lo]
        if version == 2:
            item, kind_at = int.from_bytes(data[lo + 4 : lo + 6], "big"), lo + 8
        elif version == 3 and hi - lo >= _FULL_BOX + 10:
            item, kind_at = int.from_bytes(data[lo + 4 : lo + 8], "big"), lo + 10
        else:
            continue
        types[item] = data[kind_at : kind_at + 4]
    return types


def _first_input(data: bytes, meta: tuple[int, int], primary: int) -> int | None:
    """The first item the primary is derived from (`dimg`), if it is derived."""
    iref = _child(data, *meta, b"iref")
    if iref is None or iref[1] - iref[0] < _FULL_BOX:
        return None
    id_fmt, id_size = (">I", 4) if data[iref[0]] != 0 else (">H", 2)
    for kind, lo, hi in _boxes(data, iref[0] + _FULL_BOX, iref[1]):
        if kind == b"dimg" and hi - lo >= 2 * id_size + 2:
            (source,) = struct.unpack(id_fmt, data[lo : lo + id_size])
            if source == primary:
                at = lo + id_size + 2
                return int(struct.unpack(id_fmt, data[at : at + id_size])[0])
    return None


def _codec(data: bytes, meta: tuple[int, int], primary: int) -> bytes | None:
    types = _item_types(data, meta)
    kind = types.get(primary)
    if kind in (b"grid", b"iden", b"iovl"):
        first = _first_input(data, meta, primary)
        kind = types.get(first) if first is not None else None
    return kind


def _tiles(data: bytes, meta: tuple[int, int], primary: int) -> int:
    """How many images the primary item is derived from (`dimg`), or 1."""
    iref = _child(data, *meta, b"iref")
    if iref is None or iref[1] - iref[0] < _FULL_BOX:
        return 1
    wide = data[iref[0]] != 0  # version 1: 32-bit item ids
    id_fmt, id_size = (">I", 4) if wide else (">H", 2)
    for kind, lo, hi in _boxes(data, iref[0] + _FULL_BOX, iref[1]):
        if kind != b"dimg" or hi - lo < id_size + 2:
            continue
        (source,) = struct.unpack(id_fmt, data[lo : lo + id_size])
        if source == primary:
            (count,) = struct.unpack(">H", data[lo + id_size : lo + id_size + 2])
            return max(1, int(count))
    return 1


def _size(data: bytes, meta: tuple[int, int], primary: int) -> tuple[int, int] | None:
    """The `ispe` property the primary item is associated with (`iprp/ipco` + `ipma`)."""
    iprp = _child(data, *meta, b"iprp")
    if iprp is None:
        return None
    ipco = _child(data, *iprp, b"ipco")
    ipma = _child(data, *iprp, b"ipma")
    if ipco is None or ipma is None or ipma[1] - ipma[0] < _FULL_BOX + 4:
        return None
    properties = list(_boxes(data, *ipco))
    lo, hi = ipma
    version, flags = data[lo], data[lo + 3]
    at = lo + _FULL_BOX
    (entries,) = struct.unpack(">I", data[at : at + 4])
    at += 4
    id_size, index_size = (2 if version == 0 else 4), (2 if flags & 1 else 1)
    for _ in range(entries):
        if at + id_size + 1 > hi:
            return None
        item = int.from_bytes(data[at : at + id_size], "big")
        count = data[at + id_size]
        at += id_size + 1
        for _ in range(count):
            raw = int.from_bytes(data[at : at + index_size], "big")
            at += index_size
            index = raw & (0x7FFF if index_size == 2 else 0x7F)  # top bit: essential
            if item == primary and 0 < index <= len(properties):
                kind, p_lo, p_hi = properties[index - 1]
                if kind == b"ispe" and p_hi - p_lo >= _FULL_BOX + 8:
                    w, h = struct.unpack(">II", data[p_lo + 4 : p_lo + 12])
                    return int(w), int(h)
    return None


def _samples(data: bytes, start: int, end: int) -> int:
    """The largest `stsz` sample count in any track under data[start:end]."""
    most = 0
    for kind, lo, hi in _boxes(data, start, end):
        if kind in _CONTAINERS:
            most = max(most, _samples(data, lo, hi))
        elif kind == b"stsz" and hi - lo >= _FULL_BOX + 8:
            (count,) = struct.unpack(">I", data[lo + 8 : lo + 12])
            most = max(most, int(count))
    return most


def declared(data: bytes) -> Declared:
    """Tiles of the primary item and samples of the longest track, from the box headers."""
    tiles, size, codec = 1, None, None
    meta = _child(data, 0, len(data), b"meta")
    if meta is not None and meta[1] - meta[0] >= _FULL_BOX:
        inner = (meta[0] + _FULL_BOX, meta[1])
        primary = _primary(data, inner)
        if primary is not None:
            tiles, size = _tiles(data, inner, primary), _size(data, inner, primary)
            codec = _codec(data, inner, primary)
    samples = _samples(data, 0, len(data))
    return Declared(tiles=tiles, samples=samples, size=size, codec=codec)
