"""A JPEG decoded at M/8 of its size by libjpeg-turbo (simplejpeg), for both backends.

libvips' jpegload and Pillow's draft shrink by 1, 2, 4 or 8 only; libjpeg-turbo's DCT
scaling gives any M/8, and `geometry.jpeg_eighths` picks which (3/8 for sharp's task,
where sharp decodes at 1/2). simplejpeg's wheel carries libjpeg-turbo 3.1 built with its
SIMD code and arithmetic decoding; nothing comes from the system. Its decode is also
faster than libvips' jpegload at the same scale (sharp's fixture at 1/2: ~11 vs ~17 CPU
ms; whole: ~18 vs ~29), so every JPEG it takes goes through it, at whatever scale.

It takes only what it renders as the backend's own path would: a YCbCr, RGB or grey
JPEG, decoded without a single warning, and for a caller that asks, CMYK and YCCK ones as
CMYK (never converted here: the backends colour-manage them through LittleCMS, and
simplejpeg's own conversion is naive). Damaged data (truncated, a bad Huffman code,
extraneous bytes: `jpegcheck.is_damage`) is `corrupt_content` here, on the first attempt.
Whatever else libjpeg-turbo warns about or refuses (an unknown JFIF revision, 12-bit,
lossless), and CMYK for a caller that does not ask: `None`, and the backend's own path
decodes the file, after `jpegcheck.check_jpeg` has looked at its data. The caller reads
the header and checks the limits first, and applies the ICC profile and EXIF orientation
from that header after the decode, as its own path does. libjpeg-turbo decodes the whole image at
once where libvips streams it: an image larger than `MAX_DECODED_BYTES` at its scale is
left to libvips (and Pillow's own decoder, which holds it whole anyway).

The pixels come back as a numpy array: numpy (and simplejpeg) load with the first JPEG a
worker decodes, never in the supervisor (tests/test_boot.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from derivd.handlers.jpegcheck import raise_if_damage, simplejpeg

# The most bytes one fast decode may hold: a 12 MP phone photo whole (36 MiB) fits, so
# a 1600 px preview of it (decoded whole: the shrink, 2.5, leaves no DCT scale room) is
# decoded in ~60 % of jpegload's CPU; a 48 MP one whole does not, and streams in libvips.
MAX_DECODED_BYTES = 64 * 1024 * 1024

# simplejpeg's colour spaces (TurboJPEG's TJCS_*) the fast path renders: YCbCr and
# RGB-coded JPEGs come out in colour, grey ones grey, CMYK and YCCK ones (if asked) CMYK.
_COLOUR = frozenset({"YCbCr", "RGB"})
_CMYK = frozenset({"CMYK", "YCCK"})
# Bytes a pixel of each mode (Pillow's names, and simplejpeg's but GRAY): RGB for libvips;
# RGBX for Pillow, which stores RGB as 4 bytes a pixel and so reads RGBX in place.
_BYTES = {"RGB": 3, "RGBX": 4, "L": 1, "CMYK": 4}


@dataclass(frozen=True)
class Scaled:
    """The decoded pixels: `height` rows of `width` pixels of `mode` (L, RGB, RGBX, or
    CMYK with the values the file stores, inverted in Adobe's files), the stored image
    (EXIF orientation not applied) at `eighths`/8 of each side."""

    pixels: Any  # a C-contiguous uint8 numpy array; any buffer-protocol reader takes it
    width: int
    height: int
    mode: str
    eighths: int
    stored: tuple[int, int]

    @property
    def extent(self) -> tuple[float, float]:
        """How many of its own pixels the stored image spans: its size at eighths/8 before
        rounding. The last column and row are part of a pixel where that is no whole
        number (sharp's fixture at 3/8: 1021.875 x 834.375 in 1022 x 835). A resize that
        scales by the rounded size shifts the image by up to most of a pixel (SSIM 0.967
        against the full decode on sharp's fixture, 0.992 at the exact scale)."""
        return self.stored[0] * self.eighths / 8, self.stored[1] * self.eighths / 8


def scaled_size(stored: tuple[int, int], eighths: int) -> tuple[int, int]:
    """libjpeg-turbo's size of `stored` decoded at eighths/8 (TJSCALED: rounded up)."""
    return -(-stored[0] * eighths // 8), -(-stored[1] * eighths // 8)


def decode_scaled(original: bytes, stored: tuple[int, int], eighths: int, colour: str = "RGB",
                  max_bytes: int = MAX_DECODED_BYTES, cmyk: bool = False
                  ) -> Scaled | None:  # fmt: skip
    """The JPEG at `eighths`/8 of its stored size, colour ones as `colour` (RGB or RGBX),
    CMYK and YCCK ones as CMYK when `cmyk`, or None where the backend's own path must
    decode it (see the module docstring), or when it would take more than `max_bytes`;
    CorruptContent for damaged data. `stored` is the size the backend's header read; a
    file whose frame header libjpeg-turbo reads otherwise is not taken either."""
    turbo = simplejpeg()
    try:
        height, width, colourspace, _ = turbo.decode_jpeg_header(original)
    except ValueError:
        return None
    mode = (colour if colourspace in _COLOUR else "L" if colourspace == "Gray"
            else "CMYK" if cmyk and colourspace in _CMYK else None)  # fmt: skip
    want = scaled_size(stored, eighths)
    if mode is None or (width, height) != stored:
        return None
    if want[0] * want[1] * _BYTES[mode] > max_bytes:
        return None
    # simplejpeg takes the smallest of libjpeg-turbo's M/8 scales that gives at least the
    # size asked for: asking for M/8's own size gives M/8 (or, on a side under 8 pixels, a
    # smaller M with the same size). No size asked for: the whole image.
    least = want if eighths < 8 else (0, 0)
    wanted = "GRAY" if mode == "L" else mode
    try:
        pixels = turbo.decode_jpeg(original, colorspace=wanted, min_width=least[0],
                                   min_height=least[1], strict=True)  # fmt: skip
    except ValueError as e:  # strict: every libjpeg-turbo warning is one
        raise_if_damage(str(e))  # corrupt_content, on the first attempt
        return None
    if (pixels.shape[1], pixels.shape[0]) != want:
        return None
    return Scaled(pixels, want[0], want[1], mode, eighths, stored)
