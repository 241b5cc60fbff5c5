"""Output geometry, shared by every backend so that all produce the same dimensions.

Everything here is pure arithmetic on the upright size of the original (EXIF orientation
applied). A handler decodes once, to `base_size` (the scale the largest variant needs, never
above the original), then derives each variant from that base:

- `inside`: the whole image scaled to fit the box (`EDGE` is an EDGE x EDGE box).
- `cover`: a window of the box's aspect ratio is cut from the base (centred, or placed by a
  smart-crop measure), then scaled to fill the box exactly. Cropping before scaling keeps an
  upscaled cover of a 1 x 20000 strip at 320 x 320 pixels instead of 320 x 6 400 000.

Without `upscale` nothing grows: an inside variant stops at the original's size and a cover
variant of a small original is the largest part of the box the original can fill.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from derivd.handlers.base import VariantSpec


def _side(length: int, scale: float) -> int:
    return max(1, round(length * scale))


def scale_of(width: float, height: float, variant: VariantSpec) -> float:
    """The factor this variant applies to the upright original."""
    box_w, box_h = variant.bounds
    if variant.fit == "cover":
        scale = max(box_w / width, box_h / height)
    else:
        scale = min(box_w / width, box_h / height)
    return scale if variant.upscale else min(1.0, scale)


def output_size(width: int, height: int, variant: VariantSpec) -> tuple[int, int]:
    """The exact (width, height) of the variant for an upright original of this size."""
    scale = scale_of(width, height, variant)
    out_w, out_h = _side(width, scale), _side(height, scale)
    if variant.fit == "cover":
        box_w, box_h = variant.bounds
        return min(box_w, out_w), min(box_h, out_h)
    return out_w, out_h


def base_size(width: int, height: int, variants: tuple[VariantSpec, ...]) -> tuple[int, int]:
    """The size to decode to: what the most demanding variant needs, at most the original."""
    if not variants:
        return width, height
    scale = min(1.0, max(scale_of(width, height, v) for v in variants))
    return _side(width, scale), _side(height, scale)


@dataclass(frozen=True)
class Window:
    """The part of the base a cover variant keeps: its size, and how far it may move."""

    width: int
    height: int
    slack_x: int  # base width - window width: the range of `left`
    slack_y: int

    def centred(self) -> tuple[int, int]:
        return self.slack_x // 2, self.slack_y // 2


def cover_window(original: tuple[int, int], base: tuple[int, int], variant: VariantSpec) -> Window:
    """The window, in base pixels, that scales to the cover variant's output."""
    out_w, out_h = output_size(*original, variant)
    # Base pixels per output pixel: the base is the original at base/original, and the
    # output is the original at `scale_of`.
    per_out = (base[0] / original[0]) / scale_of(*original, variant)
    win_w = min(base[0], max(1, round(out_w * per_out)))
    win_h = min(base[1], max(1, round(out_h * per_out)))
    return Window(win_w, win_h, base[0] - win_w, base[1] - win_h)


# `[derive] shrink_on_load`: `fast` (sharp's default, `fastShrinkOnLoad`) decodes at the
# largest reduction that still gives the final resize enough pixels; `safe` leaves that
# resize a factor of at least 2 (libvips' own `thumbnail` rule: a little sharper on fine
# detail, slower); `off` decodes at full size (the reference the tests and bench/sharp.py
# hold the other two to; not a setting).
def _common_shrink(original: tuple[int, int], base: tuple[int, int]) -> Fraction:
    """How much both axes of `original` shrink to reach `base` (same orientation), exactly."""
    return min(Fraction(original[0], base[0]), Fraction(original[1], base[1]))


# A JPEG decoder's DCT scaling gives each side at M/8 (libjpeg's jdmaster.c; libjpeg-turbo
# rounds the scaled side up). What each decoder derivd uses offers, in eighths:
# libvips' jpegload (and Pillow's draft) only shrink 1, 2, 4 or 8; libjpeg-turbo through
# simplejpeg (handlers/jpegscale.py) also 3/8. Its 5/8, 6/8 and 7/8 run C inverse DCTs
# where 8/8 has a SIMD one: on sharp's fixture 5/8 took 27 ms against 18 ms for the whole
# image, so they are never worth asking for (3/8, also in C, costs ~2 ms more than 4/8 and
# saves more than that in the resize after it).
SHRINK_EIGHTHS = (1, 2, 4, 8)
TURBO_EIGHTHS = (1, 2, 3, 4, 8)


def jpeg_eighths(original: tuple[int, int], base: tuple[int, int], mode: str,
                 offered: tuple[int, ...] = TURBO_EIGHTHS) -> int:  # fmt: skip
    """The DCT scale, in eighths, to decode `original` at on the way to `base`: the
    smallest of `offered` whose pixels still leave the resize its headroom.

    The headroom is sharp's rule (src/pipeline.cc) for its shrinks 8, 4, 2, written for
    any M/8: the decode's own reduction (8/M) at most the shrink minus one (`fast`; sharp
    lowers its factor once when it equals the shrink's integer part, where libjpeg's
    rounding of the scaled size would leave the resize nothing to smooth), at most half
    the shrink (`safe`). So the decoded image covers `base` however the decoder rounds
    (libvips rounds down, libjpeg-turbo and Pillow's draft up). Sharp's fixture, 2725 x
    2225 to a 720 x 588 cover (shrink 3.78): 3/8 (1022 x 835) where sharp decodes at 1/2.
    """
    if mode == "off":
        return 8
    shrink = _common_shrink(original, base)
    reach = shrink / 2 if mode == "safe" else shrink - 1
    return next((m for m in sorted(offered) if m * reach >= 8), 8)


def jpeg_shrink(original: tuple[int, int], base: tuple[int, int], mode: str) -> int:
    """The same rule for a decoder that only shrinks by 1, 2, 4 or 8 (libvips' jpegload,
    Pillow's draft): the factor to pass it."""
    return 8 // jpeg_eighths(original, base, mode, SHRINK_EIGHTHS)


def webp_scale(original: tuple[int, int], base: tuple[int, int], mode: str) -> float:
    """libwebp's scaled decode: to `base` itself when `fast` (as libvips' thumbnail and
    sharp do), to twice it when `safe`; never up."""
    if mode == "off":
        return 1.0
    shrink = _common_shrink(original, base) / (2 if mode == "safe" else 1)
    return float(1 / shrink) if shrink > 1 else 1.0
