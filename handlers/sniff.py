"""Format magic shared by the backends, so they classify damaged input the same way.

A library that cannot identify its own format (a TIFF whose IFD was cut off, a PNG with a
broken IHDR) reports the same thing as for a text file. We tell the two apart from the
magic number: bytes that start like an accepted format but cannot be read are
`corrupt_content`; anything else is `unsupported_content`.
"""

from __future__ import annotations

import struct
import zlib

_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "jpeg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
)
# ISO-BMFF brands of the HEIF family (HEIC, AVIF) in the `ftyp` box at offset 4.
_HEIF_BRANDS = frozenset(
    {b"heic", b"heix", b"hevc", b"heim", b"heis", b"mif1", b"msf1", b"avif", b"avis"}
)


def accepted_format(data: bytes) -> str | None:
    """`jpeg`, `png`, `gif`, `webp`, `tiff` or `heif` when the magic matches, else None."""
    for magic, name in _MAGIC:
        if data.startswith(magic):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data[4:8] == b"ftyp" and data[8:12] in _HEIF_BRANDS:
        return "heif"
    return None


_AVIF_BRANDS = frozenset({b"avif", b"avis"})
_HEVC_BRANDS = frozenset({b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis"})


def input_format(data: bytes) -> str | None:
    """The format name an analysis reports: `accepted_format`, with the HEIF family told
    apart by its brands: `avif` (AV1), `heic` (HEVC) or `heif` (another codec)."""
    found = accepted_format(data)
    if found != "heif":
        return found
    major = data[8:12]
    # The compatible brands follow the major brand and its 4-byte minor version.
    size = int.from_bytes(data[:4], "big")
    compatible = {data[i : i + 4] for i in range(16, min(size, len(data), 16 + 4 * 64), 4)}
    if major in _AVIF_BRANDS or (major not in _HEVC_BRANDS and compatible & _AVIF_BRANDS):
        return "avif"
    if major in _HEVC_BRANDS or compatible & _HEVC_BRANDS:
        return "heic"
    return "heif"


def gif_screen(data: bytes) -> tuple[int, int] | None:
    """The GIF logical screen size, which Pillow allocates and libvips may not report."""
    if accepted_format(data) != "gif" or len(data) < 10:
        return None
    width, height = struct.unpack("<HH", data[6:10])
    return width, height


def png_chunks_intact(data: bytes) -> bool:
    """Whether every PNG chunk up to IEND has its length inside the data and a right CRC.

    Pillow skips the CRC of IDAT chunks (libspng checks them): a flipped bit in the
    compressed pixels can then decode to a wrong image without any error.
    """
    at = 8
    while at + 12 <= len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        end = at + 8 + length
        if end + 4 > len(data):
            return False
        (crc,) = struct.unpack(">I", data[end : end + 4])
        if zlib.crc32(data[at + 4 : end]) != crc:
            return False
        if data[at + 4 : at + 8] == b"IEND":
            return True
        at = end + 4
    return False


# Baseline TIFF tags read by `tiff_tags`.
TIFF_COMPRESSION = 259
TIFF_PHOTOMETRIC = 262
TIFF_BITS_PER_SAMPLE = 258
TIFF_SAMPLES_PER_PIXEL = 277
_TIFF_SHORT, _TIFF_LONG = 3, 4


def tiff_tags(data: bytes) -> dict[int, tuple[int, int]]:
    """The integer tags of a classic TIFF's first IFD: tag -> (first value, where it is).

    `where` is the byte offset of that first value (inside the entry, or where the entry
    points), so a caller can rewrite it. Non-TIFF or damaged directories give what could
    be read, possibly nothing; the decoders report the damage themselves.
    """
    order = {b"II*\x00": "<", b"MM\x00*": ">"}.get(data[:4])
    if order is None or len(data) < 8:
        return {}
    (ifd,) = struct.unpack(order + "I", data[4:8])
    if ifd + 2 > len(data):
        return {}
    (count,) = struct.unpack(order + "H", data[ifd : ifd + 2])
    tags: dict[int, tuple[int, int]] = {}
    for entry in range(ifd + 2, min(ifd + 2 + 12 * count, len(data) - 11), 12):
        tag, kind, n = struct.unpack(order + "HHI", data[entry : entry + 8])
        size = {_TIFF_SHORT: 2, _TIFF_LONG: 4}.get(kind)
        if size is None or n < 1:
            continue
        where = entry + 8
        if size * n > 4:  # the values do not fit the entry: it holds their offset
            (where,) = struct.unpack(order + "I", data[where : where + 4])
        if where + size <= len(data):
            fmt = order + ("H" if size == 2 else "I")
            tags[tag] = (struct.unpack(fmt, data[where : where + size])[0], where)
    return tags
