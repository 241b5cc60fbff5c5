"""Encoder settings and the smart-crop measure that both built-in backends share.

Encoder parameters are pinned here so that `vips` and `pillow` write comparable files:

- webp: quality (the variant's, else `[derive] quality`); `[derive] effort` (0-6) as libvips
  `effort` and Pillow `method`; `lossless` when the variant asks.
- avif: quality mapped by `AVIF_QUALITY` (libavif's scale is not WebP's: calibrated so the
  same number gives the same fidelity); `avif_effort` e as libvips `effort` (0-9) and
  Pillow `speed` 9 - e, which are the same aom `cpu-used` (9 - e); 8-bit, 4:2:0.
- jpeg: quality; 4:2:0, optimised Huffman tables, alpha flattened onto white; written by
  one writer on both backends, libjpeg-turbo's (`pillow_variants.save_jpeg`).
- png: zlib level 6 (lossless, so no quality).

AVIF is an order of magnitude slower to encode than WebP at equal effort (bench/RESULTS.md):
`[derive] effort` 4 (the default) maps to AVIF effort 2 (aom cpu-used 7), which costs about
three times the WebP encode; each step of `[derive] effort` adds one AVIF step.

The smart-crop measure (`best_window`) places a cover window for `attention`/`entropy` where
libvips' own `smartcrop` is not used (the Pillow backend; animations on both backends, where
one position must hold for every frame). It scores candidate positions on a greyscale copy of
at most `_MEASURE_EDGE` px, and takes the best one (the most central on ties):

- `entropy`: the Shannon entropy of the window's grey histogram: busy detail beats flat sky.
- `attention`: the window's mean edge strength (Pillow's FIND_EDGES) plus its mean colour
  saturation: edges and saturated colour are what libvips' attention measure weighs most
  (it adds skin tones, which we leave out).
"""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING

from derivd.handlers.base import AVIF_MAX_PIXELS, DeriveSpec, ResourceLimit, VariantSpec
from derivd.handlers.geometry import Window

if TYPE_CHECKING:  # Pillow is imported where a smart crop is measured: a vips worker that
    # never measures one (the usual case) does not load it at all
    from PIL import Image

PNG_COMPRESSION = 6
JPEG_BACKGROUND = (255, 255, 255)
_MEASURE_EDGE = 256
_CANDIDATES = 17  # positions tried per free axis (both ends and the centre included)


def quality_of(variant: VariantSpec, spec: DeriveSpec) -> int:
    return variant.quality or spec.quality


# `quality` (WebP's scale, the one number a variant has for all its formats) -> the AVIF
# encoder's quality of the same fidelity. Chosen by `bench/avif.py --calibrate`: at WebP
# quality 50-90, the AVIF quality whose luma SSIM against the unencoded variant equals
# WebP's, median over the corpus photographs and a grainy generated scene at 1600 and 320
# px (inputs whose SSIM barely moves with quality left out); libheif (vips) and libavif
# (Pillow) agreed within 0.3. At the same quality number AVIF kept ~5x WebP's bytes on
# grainy photos; mapped, it matches WebP's SSIM with fewer bytes (bench/RESULTS.md).
AVIF_QUALITY: tuple[tuple[int, int], ...] = (
    (1, 1), (50, 49), (60, 52), (70, 56), (80, 64), (90, 81), (100, 100),
)  # fmt: skip


def avif_quality(quality: int) -> int:
    """The AVIF encoder quality for `quality` on WebP's scale (linear between the points
    of `AVIF_QUALITY`, which is read at call time: bench/avif.py swaps it to sweep)."""
    points = AVIF_QUALITY
    for (q0, a0), (q1, a1) in pairwise(points):
        if q0 <= quality <= q1:
            return round(a0 + (a1 - a0) * (quality - q0) / (q1 - q0))
    return points[0][1] if quality < points[0][0] else points[-1][1]


def avif_effort(spec: DeriveSpec) -> int:
    """libvips heifsave `effort` (0-9) for `[derive] effort` (0-6); see the table above."""
    return max(0, min(9, spec.effort - 2))


def avif_speed(spec: DeriveSpec) -> int:
    """Pillow/libavif `speed` with the same aom cpu-used as `avif_effort`."""
    return 9 - avif_effort(spec)


def check_avif_size(frames: int, width: int, height: int) -> None:
    """An animated AVIF counts every frame (a still one is bounded by the config check)."""
    if frames * width * height > AVIF_MAX_PIXELS:
        raise ResourceLimit(
            f"avif of {frames} x {width}x{height} px > AVIF_MAX_PIXELS {AVIF_MAX_PIXELS}"
        )


def best_window(image: Image.Image, window: Window, gravity: str) -> tuple[int, int]:
    """(left, top) of the window in `image`'s pixels, chosen by `gravity`."""
    if gravity == "centre" or (window.slack_x == 0 and window.slack_y == 0):
        return window.centred()
    from PIL import Image

    factor = min(1.0, _MEASURE_EDGE / max(image.size))
    small = image.convert("RGB")
    if factor < 1.0:
        small = small.resize(
            (max(1, round(image.width * factor)), max(1, round(image.height * factor))),
            Image.Resampling.BOX,
        )
    score_map = _score_map(small, gravity)
    win = (max(1, round(window.width * factor)), max(1, round(window.height * factor)))
    best: tuple[float, float, tuple[int, int]] | None = None
    for left in _positions(window.slack_x):
        for top in _positions(window.slack_y):
            x, y = round(left * factor), round(top * factor)
            box = (x, y, min(small.width, x + win[0]), min(small.height, y + win[1]))
            score = _score(score_map, box, gravity)
            # Prefer the higher score, then the position nearer the centre.
            off_centre = abs(left - window.slack_x / 2) + abs(top - window.slack_y / 2)
            if best is None or (score, -off_centre) > (best[0], best[1]):
                best = (score, -off_centre, (left, top))
    return best[2] if best else window.centred()


def _positions(slack: int) -> list[int]:
    if slack == 0:
        return [0]
    steps = min(slack, _CANDIDATES - 1)
    return sorted({round(slack * i / steps) for i in range(steps + 1)})


def _score_map(small: Image.Image, gravity: str) -> Image.Image:
    from PIL import Image, ImageFilter

    grey = small.convert("L")
    if gravity == "entropy":
        return grey
    edges = grey.filter(ImageFilter.FIND_EDGES)
    saturation = small.convert("HSV").getchannel("S")
    return Image.blend(edges, saturation, 0.5)


def _score(score_map: Image.Image, box: tuple[int, int, int, int], gravity: str) -> float:
    from PIL import ImageStat

    region = score_map.crop(box)
    if gravity == "entropy":
        return float(region.entropy())
    return float(ImageStat.Stat(region).mean[0])
