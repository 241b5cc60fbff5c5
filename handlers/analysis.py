"""The analysis of an original, from a small copy of its decoded pixels (both backends).

A backend decodes the original once; it hands this module the first frame as it will be
shown (upright, 8-bit sRGB, straight alpha), box-shrunk to `SMALL_EDGE` px or under on
its long edge by whole factors (`whole_blocks`), and the facts it read from the header.
Everything else is computed here, the same way for every backend:

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

Array arithmetic (numpy) on 32 px: ~0.1 CPU ms a file. The pure-Python port it replaced
took ~0.9 ms alone, and ~2.5 ms of user and system CPU inside a busy worker: its Python
held the GIL against the worker's store-and-commit thread (measured with bench/steps.py).
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from functools import cache
from typing import Any

from derivd.handlers.base import Analysis
from derivd.handlers.lazy_numpy import numpy

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


@dataclass(frozen=True)
class Blocks:
    """How a backend box-shrinks the first frame: blocks of `across` x `down` pixels over
    the `width` x `height` area they fill whole (the partial blocks at the right and bottom
    edges are left out)."""

    across: int
    down: int
    width: int
    height: int


def whole_blocks(width: int, height: int) -> Blocks:
    """The blocks that bring the long edge of a width x height frame to SMALL_EDGE px or
    under, no wider or taller than the frame (a 1 x 5000 line stays 1 px wide). What is
    left out is under 1/32 of each side; a fractional factor, each library's resize to an
    exact size, costs 2-3x as much in either backend."""
    factor = max(1, math.ceil(max(width, height) / SMALL_EDGE))
    across, down = min(width, factor), min(height, factor)
    return Blocks(across, down, width // across * across, height // down * down)


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
    """`#rrggbb`: the alpha-weighted mean; an entirely transparent image is black. Integer
    sums (exact), then one division per channel."""
    np = numpy()
    px = _pixels(small).astype(np.int64)
    alpha = px[..., 3]
    total = int(alpha.sum())
    if total == 0:
        return "#000000"
    sums = (px[..., :3] * alpha[..., None]).sum(axis=(0, 1))
    return "#" + "".join(f"{min(255, round(int(v) / total)):02x}" for v in sums)


def _pixels(small: Small) -> Any:
    """The small copy as a height x width x 4 uint8 array (no copy)."""
    np = numpy()
    return np.frombuffer(small.rgba, np.uint8).reshape(small.height, small.width, 4)


# Below this, a difference of sums is rounding noise (the values are at most 255, the
# float64 error of a few hundred additions ~1e-13 of that).
_TIE = 1e-9


# --- dhash -------------------------------------------------------------------------------


def dhash(small: Small) -> int:
    """The 64-bit difference hash as a signed integer (see the module docstring)."""
    grey = _grey_area(small, 9, 8)
    bits = 0
    # A tie (flat areas, synthetic gradients) is not brighter, whatever the last bits of
    # the sums: the order of additions must not decide a bit.
    for brighter in (grey[:, :-1] > grey[:, 1:] + _TIE).flat:
        bits = (bits << 1) | int(brighter)
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def _grey_area(small: Small, out_w: int, out_h: int) -> Any:
    """Luma (BT.601, composited on white) of each cell of an out_w x out_h grid (an
    out_h x out_w array), as the area-weighted mean of the pixels it covers (exact box
    filter, also when enlarging): two products with the cells' weight matrices."""
    px = _pixels(small).astype(float)
    r, g, b, a = (px[..., c] for c in range(4))
    luma = (0.299 * r + 0.587 * g + 0.114 * b) * a / 255 + 255 - a
    return _weights(small.height, out_h) @ luma @ _weights(small.width, out_w).T


@cache
def _weights(size: int, cells: int) -> Any:
    """A cells x size matrix: row i holds the weights (summing to 1) with which source
    index j counts in cell i, which spans [i * size / cells, (i + 1) * size / cells)."""
    np = numpy()
    out = np.zeros((cells, size))
    for i in range(cells):
        lo, hi = i * size / cells, (i + 1) * size / cells
        for j in range(math.floor(lo), min(size, math.ceil(hi))):
            overlap = min(hi, j + 1) - max(lo, j)
            if overlap > 0:
                out[i, j] = overlap / (hi - lo)
    out.flags.writeable = False  # cached: shared by every call
    return out


# --- ThumbHash (port of evanw/thumbhash's rgbaToThumbHash) -----------------------------


def thumbhash(small: Small) -> bytes:
    """ThumbHash bytes of the image: the reference encoder's arithmetic, as arrays
    (JavaScript's Math.round, which rounds halves up, where the reference rounds)."""
    w, h = small.width, small.height
    px = _pixels(small) / 255
    alpha = px[..., 3]
    avg_a = float(alpha.sum())
    avg = (px[..., :3] * alpha[..., None]).sum(axis=(0, 1))
    if avg_a:
        avg = avg / avg_a
    has_alpha = avg_a < w * h
    l_limit = 5 if has_alpha else 7  # fewer luminance bits when alpha needs some
    lx = max(1, _round(l_limit * w / max(w, h)))
    ly = max(1, _round(l_limit * h / max(w, h)))

    # RGBA to LPQA, composited atop the average colour.
    rgb = avg * (1 - alpha[..., None]) + alpha[..., None] * px[..., :3]
    red, green, blue = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    lum = (red + green + blue) / 3
    p = (red + green) / 2 - blue
    q = red - green

    l_dc, l_ac, l_scale = _encode_channel(lum, max(3, lx), max(3, ly))
    p_dc, p_ac, p_scale = _encode_channel(p, 3, 3)
    q_dc, q_ac, q_scale = _encode_channel(q, 3, 3)
    a_dc, a_ac, a_scale = _encode_channel(alpha, 5, 5) if has_alpha else (0.0, [], 0.0)

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


def _encode_channel(channel: Any, nx: int, ny: int) -> tuple[float, list[float], float]:
    """DC, normalised AC terms and their scale for the triangle of DCT terms the reference
    keeps (cx * ny < nx * (ny - cy)), all terms at once: cos_y @ channel @ cos_x.T."""
    h, w = channel.shape
    terms = (_cosines(h, ny) @ channel @ _cosines(w, nx).T) / (w * h)  # [cy, cx]
    # A term that is zero in exact arithmetic (a symmetric image) is zero, not the
    # rounding noise of the sums, which would pick its nibble's side of the 7.5 tie.
    terms[abs(terms) < _TIE] = 0.0
    dc, ac = 0.0, []
    for cy in range(ny):
        cx = 0
        while cx * ny < nx * (ny - cy):
            if cx or cy:
                ac.append(float(terms[cy, cx]))
            else:
                dc = float(terms[0, 0])
            cx += 1
    scale = max(map(abs, ac), default=0.0)
    if scale:
        ac = [0.5 + 0.5 / scale * f for f in ac]
    return dc, ac, scale


@cache
def _cosines(size: int, terms: int) -> Any:
    """The DCT basis, a terms x size matrix: cos(pi / size * k * (i + 0.5))."""
    np = numpy()
    k = np.arange(terms)[:, None]
    out = np.cos(np.pi / size * k * (np.arange(size)[None, :] + 0.5))
    out.flags.writeable = False  # cached: shared by every call
    return out
