"""HEIC/HEIF decoding for both backends, through one decoder: pi-heif.

Neither bundled library decodes HEVC: the pyvips-binary build of libvips has no HEVC
decoder, and Pillow has no HEIF plugin. pi-heif is the decode-only build of pillow-heif:
its wheels carry libheif and libde265 (both LGPL) and no encoder (pillow-heif's wheels add
x265, which is GPL, and AV1 codecs derivd already has). AVIF keeps its own path (libvips'
heifload, Pillow's AVIF plugin); everything else of the HEIF family comes here.

Per job: the limits from the boxes and the header (tiles of the primary image and samples
of a sequence from `isobmff`, then pixels and top-level images from libheif's handles),
none of which decodes a pixel; then the primary image only, with libheif applying its
`irot`/`imir`/`clap` transforms (EXIF orientation is never read for HEIF), high bit
depths reduced to 8, alpha kept. Depth maps, auxiliary images and thumbnails are never
opened. The caller converts the embedded ICC profile (Display P3 on iPhones) to sRGB.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from derivd.handlers.base import (
    HEIF_MAX_TILES,
    CorruptContent,
    DeriveSpec,
    Permanent,
    ResourceLimit,
    UnsupportedContent,
    check_declared_size,
)
from derivd.handlers.isobmff import Declared, declared
from derivd.handlers.sniff import input_format

if TYPE_CHECKING:  # Pillow only for deep or premultiplied pixels (imported there)
    from PIL import Image

# libheif's words (pi-heif passes them on as the exception text) for a codec this build
# lacks (AV1 in a non-AVIF file, JPEG 2000, H.264, VVC) and for its own security limits.
_NO_CODEC = ("not been built in", "Unsupported codec")
_OVER_LIMIT = "ecurity limit"
_EIGHT_BIT = frozenset({"L", "LA", "RGB", "RGBA"})
# Item types whose pixels pi-heif decodes: HEVC (libde265) and libheif's own uncompressed
# and mask codecs. AV1 outside an AVIF-branded file, VVC, JPEG 2000, H.264 and JPEG in
# HEIF are valid files this build cannot decode: unsupported_content.
_DECODABLE = frozenset({b"hvc1", b"unci", b"mski"})


@cache
def libheif(threads: int) -> Any:  # pi_heif carries no types
    """pi-heif, loaded with the first HEIF file a worker gets, not at its boot (a vips
    worker that never gets one never maps libheif, libde265 and Pillow: ~6 MiB of its
    RSS and ~30 ms of its boot), with its process-wide settings: never touch what we
    ignore, decode with our threads."""
    import pi_heif

    pi_heif.options.DEPTH_IMAGES = False
    pi_heif.options.AUX_IMAGES = False
    pi_heif.options.THUMBNAILS = False
    pi_heif.options.DECODE_THREADS = max(1, threads)
    return pi_heif


def is_heif(original: bytes) -> bool:
    """HEIF whose pixels this module decodes: every brand of the family but AVIF."""
    return input_format(original) in ("heic", "heif")


@dataclass(frozen=True)
class Header:
    """The primary image as displayed (after libheif's transforms) and the file's images."""

    width: int
    height: int
    frames: int  # top-level images (a burst), or a sequence's samples when more
    image: Any  # pi_heif.HeifImage: decoded on first access to its pixels


def check_boxes(boxes: Declared, spec: DeriveSpec) -> None:
    """The limits a file of the HEIF family declares in its boxes, before any decoder
    sees it: the primary image's tiles (each one a decode) and a sequence's samples.
    HEIC and AVIF alike: libavif and libvips' heifload take a grid of thousands of
    tiles or a track of thousands of frames as readily as libheif does."""
    if boxes.tiles > HEIF_MAX_TILES:
        raise ResourceLimit(f"{boxes.tiles} tiles > HEIF_MAX_TILES {HEIF_MAX_TILES}")
    if boxes.samples > spec.max_frames:
        raise ResourceLimit(f"{boxes.samples} frames > max_frames {spec.max_frames}")


def check_avif(original: bytes, spec: DeriveSpec) -> Declared:
    """An AVIF's box-level limits (check_boxes), the same as a HEIC's; its boxes."""
    boxes = declared(original)
    check_boxes(boxes, spec)
    return boxes


def read_header(original: bytes, spec: DeriveSpec) -> Header:
    """Open the file (boxes and handles only) and check every limit before any decode."""
    boxes = declared(original)
    if boxes.codec is not None and boxes.codec not in _DECODABLE:
        codec = boxes.codec.decode("latin-1")
        raise UnsupportedContent(f"HEIF image coded as {codec!r}: no decoder in this build")
    check_boxes(boxes, spec)
    try:
        heif = libheif(spec.concurrency).open_heif(original, convert_hdr_to_8bit=True)
        image = heif[heif.primary_index]
        width, height = image.size
    except Exception as error:  # libheif on user bytes: see `_classify`
        raise _classify(error) from None
    frames = max(len(heif), boxes.samples, 1)
    # Only the primary image is decoded: the pixel limit counts it once.
    check_declared_size(width, height, frames, spec, decoded_frames=1)
    return Header(width, height, frames, image)


@dataclass(frozen=True)
class Pixels:
    """The decoded primary image: 8-bit, packed rows, `mode` one of L, LA, RGB, RGBA."""

    data: bytes | memoryview  # libheif's buffer itself where no conversion was needed
    width: int
    height: int
    mode: str
    icc: bytes | None

    @property
    def bands(self) -> int:
        return len(self.mode)


def decode(header: Header) -> Pixels:
    """The primary image's pixels. libheif's own 8-bit output is handed on as it is (no
    copy); deep grey and premultiplied alpha go through Pillow to 8-bit, straight alpha."""
    try:
        image = header.image
        mode, (width, height), data, stride = image.mode, image.size, image.data, image.stride
    except Exception as error:
        raise _classify(error) from None
    icc = image.info.get("icc_profile") or None
    if mode in _EIGHT_BIT and stride == width * len(mode):
        return Pixels(data, width, height, mode, icc)
    from PIL import Image

    converted = _eight_bit(Image.frombytes(mode, (width, height), data, "raw", mode, stride))
    return Pixels(converted.tobytes(), width, height, converted.mode, icc)


def to_pillow(pixels: Pixels) -> Image.Image:
    """The pixels as a Pillow image, the ICC profile in `info` (as Pillow's decoders do)."""
    from PIL import Image

    size = (pixels.width, pixels.height)
    image = Image.frombytes(pixels.mode, size, pixels.data)
    if pixels.icc:
        image.info["icc_profile"] = pixels.icc
    return image


def _eight_bit(image: Image.Image) -> Image.Image:
    """pi-heif hands deep grey as I;16 (scaled to 16 bits) and alpha as RGBa when the
    file says premultiplied: 8-bit, straight alpha."""
    if image.mode.startswith("I;16"):
        return image.convert("I").point(lambda v: v * (1 / 257)).convert("L")
    return image.convert("RGBA" if "A" in image.mode or "a" in image.mode else "RGB")


def _classify(error: Exception) -> Permanent:
    text = str(error)
    if any(words in text for words in _NO_CODEC):
        return UnsupportedContent(f"HEIF codec not in this build: {text[:200]}")
    if _OVER_LIMIT in text:
        return ResourceLimit(f"libheif limit: {text[:200]}")
    if isinstance(error, MemoryError):
        return ResourceLimit("out of memory while decoding HEIF")
    return CorruptContent(f"HEIF decode failed: {type(error).__name__}: {text[:200]}")
