"""The analysis of an original, from a small copy of its decoded pixels (both backends).

A backend decodes the original once; it hands this module the first frame as it will be
shown (upright, 8-bit sRGB, straight alpha), shrunk to `SMALL_EDGE` px on its long
edge, and the facts it read from the header. Everything else is computed here, the same way
for every backend:

- `has_alpha` (the backend's): some pixel of the first frame is less than opaque.
- `colour`: the representative colour, the alpha-weighted mean of the sRGB pixels
  (`#rrggbb`): what a page paints before anything has loaded.
- `placeholder`: ThumbHash (Evan Wallace, MIT, github.com/evanw/thumbhash), ported from
  its reference encoder: a ~25-byte DCT of the image in an LPQA colour space, base64. Its
  DC terms are the mean colour; a client renders it with the reference decoder.
- `dhash`: the 64-bit difference hash: the image as 9 x 8 grey (area average), one bit
  per horizontal neighbour pair (left brighter than right), row by row, most significant
  bit first, as a signed 64-bit integer (PostgreSQL `bigint`). Re-encodes and rescales of
  one picture stay within a few bits; unrelated pictures differ by about 32.

Pure Python on 32 px: 1-2.5 CPU ms a file inside a worker (the bits the same as the
plain per-pixel port: table look-ups and cached bases, not other arithmetic).
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from functools import cache
from operator import mul

from derivd.handlers.base import Analysis

THUMBHASH_MAX = 100  # ThumbHash's own bound on its input
# What backends shrink to. ThumbHash keeps at most 7 x 7 DCT terms and dhash 9 x 8 cells:
# 32 px holds both, and pure Python stays near a millisecond (100 px: ~10x that).
SMALL_EDGE = 32


@dataclass(frozen=True)
class Small:
    """An RGBA copy of the first frame, at most THUMBHASH_MAX px on each side."""

    width: int
    height: int
    rgba: bytes  # width * height * 4, straight (not premultiplied) alpha

    def __post_init__(self) -> None:
        if not (0 < self.width <= THUMBHASH_MAX and 0 < self.height <= THUMBHASH_MAX):
            raise ValueError(f"{self.width}x{self.height} does not fit {THUMBHASH_MAX} px")
        if len(self.rgba) != self.width * self.height * 4:
            raise ValueError("rgba is not width * height * 4 bytes")


def rgba_of(pixels: bytes, bands: int) -> bytes:
    """8-bit interleaved grey, grey + alpha, RGB or RGBA pixels as RGBA (opaque where
    there is no alpha): a backend hands over its small copy as it comes, without asking
    its library for the extra bands (each libvips operation costs more than this)."""
    if bands == 4:
        return pixels
    count = len(pixels) // bands
    out = bytearray(b"\xff" * (count * 4))
    for channel in range(3):
        out[channel::4] = pixels[(channel if bands >= 3 else 0) :: bands]
    if bands == 2:
        out[3::4] = pixels[1::2]
    return bytes(out)


def small_size(width: int, height: int) -> tuple[int, int]:
    """The size a backend shrinks the first frame to (aspect kept, both sides >= 1)."""
    scale = min(1.0, SMALL_EDGE / max(width, height))
    return max(1, round(width * scale)), max(1, round(height * scale))


def analyse(
    small: Small, *, width: int, height: int, fmt: str, frames: int, has_alpha: bool
) -> Analysis:
    """The Analysis of an original displayed at width x height (see the module docstring)."""
    return Analysis(
        width=width,
        height=height,
        format=fmt,
        frames=frames,
        has_alpha=has_alpha,
        colour=mean_colour(small),
        placeholder=base64.b64encode(thumbhash(small)).decode("ascii"),
        dhash=dhash(small),
    )


def mean_colour(small: Small) -> str:
    """`#rrggbb`: the alpha-weighted mean; an entirely transparent image is black."""
    px = small.rgba
    alpha = px[3::4]
    total = sum(alpha)
    if total == 0:
        return "#000000"
    if total == 255 * len(alpha):  # opaque: integer sums, the same values as weighted ones
        channels = (255 * sum(px[c::4]) / total for c in range(3))
    else:
        channels = (sum(map(mul, px[c::4], alpha)) / total for c in range(3))
    return "#" + "".join(f"{min(255, round(v)):02x}" for v in channels)


# --- dhash -------------------------------------------------------------------------------


def dhash(small: Small) -> int:
    """The 64-bit difference hash as a signed integer (see the module docstring)."""
    grey = _grey_area(small, 9, 8)
    bits = 0
    for y in range(8):
        row = grey[y * 9 : y * 9 + 9]
        for x in range(8):
            bits = (bits << 1) | (row[x] > row[x + 1])
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def _grey_area(small: Small, out_w: int, out_h: int) -> list[float]:
    """Luma (BT.601, composited on white) of each cell of an out_w x out_h grid, as the
    area-weighted mean of the pixels it covers (exact box filter, also when enlarging)."""
    w, h, px = small.width, small.height, small.rgba
    luma = [
        (0.299 * r + 0.587 * g + 0.114 * b) * a / 255 + 255 - a
        for r, g, b, a in zip(px[0::4], px[1::4], px[2::4], px[3::4], strict=True)
    ]
    xs, ys = _weights(w, out_w), _weights(h, out_h)
    out = []
    for wy in ys:
        for wx in xs:
            acc = 0.0
            for y, fy in wy:
                row = y * w
                acc += fy * sum(luma[row + x] * fx for x, fx in wx)
            out.append(acc)
    return out


@cache
def _weights(size: int, cells: int) -> tuple[tuple[tuple[int, float], ...], ...]:
    """For each of `cells` output cells, the source indices it covers with their weights
    (summing to 1): cell i spans [i * size / cells, (i + 1) * size / cells)."""
    out = []
    for i in range(cells):
        lo, hi = i * size / cells, (i + 1) * size / cells
        span = []
        for j in range(math.floor(lo), min(size, math.ceil(hi))):
            overlap = min(hi, j + 1) - max(lo, j)
            if overlap > 0:
                span.append((j, overlap / (hi - lo)))
        out.append(tuple(span))
    return tuple(out)


# --- ThumbHash (port of evanw/thumbhash's rgbaToThumbHash) -----------------------------


def thumbhash(small: Small) -> bytes:
    """ThumbHash bytes of the image; the reference encoder, step for step (JavaScript's
    Math.round, which rounds halves up, where the reference rounds)."""
    w, h, px = small.width, small.height, small.rgba
    n = w * h
    # Table look-ups for v / 255, an opaque image's weights skipped, the DCT basis cached
    # (`_cosines`): the reference's float operations in its order, so the same bits.
    red, green, blue = (list(map(_UNIT, px[c::4])) for c in range(3))
    alpha_bytes = px[3::4]
    if alpha_bytes.count(255) == n:  # opaque: every weight is 1.0, every product the value
        alpha = [1.0] * n
        avg_a = float(n)
        avg = [sum(channel) for channel in (red, green, blue)]
    else:
        alpha = list(map(_UNIT, alpha_bytes))
        avg_a = sum(alpha)
        avg = [sum(map(mul, alpha, channel)) for channel in (red, green, blue)]
    if avg_a:
        avg = [v / avg_a for v in avg]
    has_alpha = avg_a < n
    l_limit = 5 if has_alpha else 7  # fewer luminance bits when alpha needs some
    lx = max(1, _round(l_limit * w / max(w, h)))
    ly = max(1, _round(l_limit * h / max(w, h)))

    # RGBA to LPQA, composited atop the average colour.
    if has_alpha:
        red, green, blue = (
            [m * (1 - a) + a * v for a, v in zip(alpha, channel, strict=True)]
            for m, channel in zip(avg, (red, green, blue), strict=True)
        )
    lum = [(r + g + b) / 3 for r, g, b in zip(red, green, blue, strict=True)]
    p = [(r + g) / 2 - b for r, g, b in zip(red, green, blue, strict=True)]
    q = [r - g for r, g in zip(red, green, strict=True)]

    l_dc, l_ac, l_scale = _encode_channel(lum, w, h, max(3, lx), max(3, ly))
    p_dc, p_ac, p_scale = _encode_channel(p, w, h, 3, 3)
    q_dc, q_ac, q_scale = _encode_channel(q, w, h, 3, 3)
    a_dc, a_ac, a_scale = _encode_channel(alpha, w, h, 5, 5) if has_alpha else (0.0, [], 0.0)

    landscape = w > h
    header24 = (
        _round(63 * l_dc)
        | (_round(31.5 + 31.5 * p_dc) << 6)
        | (_round(31.5 + 31.5 * q_dc) << 12)
        | (_round(31 * l_scale) << 18)
        | (int(has_alpha) << 23)
    )
    header16 = (
        (ly if landscape else lx)
        | (_round(63 * p_scale) << 3)
        | (_round(63 * q_scale) << 9)
        | (int(landscape) << 15)
    )
    out = [header24 & 255, (header24 >> 8) & 255, header24 >> 16, header16 & 255, header16 >> 8]
    if has_alpha:
        out.append(_round(15 * a_dc) | (_round(15 * a_scale) << 4))
    factors = [*l_ac, *p_ac, *q_ac, *a_ac]
    start = len(out)
    out.extend([0] * ((len(factors) + 1) // 2))
    for index, f in enumerate(factors):
        out[start + (index >> 1)] |= _round(15 * f) << ((index & 1) << 2)
    return bytes(out)


def _round(value: float) -> int:
    """JavaScript's Math.round: halves go up (Python's round goes to even)."""
    return math.floor(value + 0.5)


def _encode_channel(
    channel: list[float], w: int, h: int, nx: int, ny: int
) -> tuple[float, list[float], float]:
    """DC, normalised AC terms and their scale for the triangle of DCT terms the reference
    keeps (cx * ny < nx * (ny - cy)). Separable: each row is folded with each x basis once,
    then the column sums with the y basis."""
    fx = _cosines(w, nx)  # cx ranges below nx for cy = 0, fewer for higher cy
    rows = [channel[y * w : y * w + w] for y in range(h)]
    folded = [[sum(map(mul, row, basis)) for row in rows] for basis in fx]  # [cx][y]
    fys = _cosines(h, ny)
    dc, ac, scale = 0.0, [], 0.0
    for cy in range(ny):
        fy = fys[cy]
        cx = 0
        while cx * ny < nx * (ny - cy):
            f = sum(map(mul, folded[cx], fy)) / (w * h)
            if cx or cy:
                ac.append(f)
                scale = max(scale, abs(f))
            else:
                dc = f
            cx += 1
    if scale:
        ac = [0.5 + 0.5 / scale * f for f in ac]
    return dc, ac, scale


@cache
def _cosines(size: int, terms: int) -> tuple[tuple[float, ...], ...]:
    """The DCT basis: cos(pi / size * k * (i + 0.5)) for each term k and index i."""
    return tuple(tuple(math.cos(math.pi / size * k * (i + 0.5)) for i in range(size))
                 for k in range(terms))  # fmt: skip


_UNIT = tuple(v / 255 for v in range(256)).__getitem__  # v / 255, as the reference divides
