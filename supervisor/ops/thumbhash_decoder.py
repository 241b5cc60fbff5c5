"""The demo gallery's ThumbHash decoder: paints a placeholder (docs/integrating.md,
"Analysis of the original") with the reference decoder of Evan Wallace's ThumbHash (MIT,
github.com/evanw/thumbhash, `thumbHashToRGBA`), ported step for step, and a PNG of the
result for the gallery (a data URI: no script on the page).

What an app does in its own client; derivd itself only encodes (derivd.handlers).
"""

from __future__ import annotations

import base64
import io
import math

from PIL import Image


def aspect_ratio(hash_bytes: bytes) -> float:
    """Width / height, approximately, from the header (thumbHashToApproximateAspectRatio)."""
    header = hash_bytes[3]
    has_alpha = hash_bytes[2] & 0x80
    landscape = hash_bytes[4] & 0x80
    lx = (5 if has_alpha else 7) if landscape else header & 7
    ly = header & 7 if landscape else (5 if has_alpha else 7)
    return lx / ly


def dc_terms(hash_bytes: bytes) -> tuple[float, float, float]:
    """The L, P and Q DC terms of the header."""
    h24 = hash_bytes[0] | (hash_bytes[1] << 8) | (hash_bytes[2] << 16)
    return (h24 & 63) / 63, ((h24 >> 6) & 63) / 31.5 - 1, ((h24 >> 12) & 63) / 31.5 - 1


def lpq_to_rgb(lum: float, p: float, q: float) -> tuple[float, float, float]:
    """LPQ back to RGB (unclamped)."""
    b = lum - 2 / 3 * p
    r = (3 * lum - b + q) / 2
    return r, r - q, b


def to_rgba(hash_bytes: bytes) -> tuple[int, int, bytes]:
    """(width, height, RGBA bytes) of the placeholder, at most 32 px a side."""
    h24 = hash_bytes[0] | (hash_bytes[1] << 8) | (hash_bytes[2] << 16)
    h16 = hash_bytes[3] | (hash_bytes[4] << 8)
    l_dc, p_dc, q_dc = dc_terms(hash_bytes)
    l_scale = ((h24 >> 18) & 31) / 31
    has_alpha = bool(h24 >> 23)
    p_scale = ((h16 >> 3) & 63) / 63
    q_scale = ((h16 >> 9) & 63) / 63
    landscape = bool(h16 >> 15)
    lx = max(3, (5 if has_alpha else 7) if landscape else h16 & 7)
    ly = max(3, h16 & 7 if landscape else (5 if has_alpha else 7))
    a_dc = (hash_bytes[5] & 15) / 15 if has_alpha else 1.0
    a_scale = (hash_bytes[5] >> 4) / 15 if has_alpha else 0.0

    # The AC factors, 4 bits each (saturation boosted 1.25x against quantisation).
    nibbles = _Nibbles(hash_bytes, 6 if has_alpha else 5)
    l_ac = nibbles.channel(lx, ly, l_scale)
    p_ac = nibbles.channel(3, 3, p_scale * 1.25)
    q_ac = nibbles.channel(3, 3, q_scale * 1.25)
    a_ac = nibbles.channel(5, 5, a_scale) if has_alpha else []

    ratio = aspect_ratio(hash_bytes)
    w = _round(32 if ratio > 1 else 32 * ratio)
    h = _round(32 / ratio if ratio > 1 else 32)
    out = bytearray(w * h * 4)
    n_x, n_y = max(lx, 5 if has_alpha else 3), max(ly, 5 if has_alpha else 3)
    for y in range(h):
        fy = [math.cos(math.pi / h * (y + 0.5) * cy) for cy in range(n_y)]
        for x in range(w):
            fx = [math.cos(math.pi / w * (x + 0.5) * cx) for cx in range(n_x)]
            lum = l_dc + _sum(l_ac, fx, fy, lx, ly)
            p = p_dc + _sum(p_ac, fx, fy, 3, 3)
            q = q_dc + _sum(q_ac, fx, fy, 3, 3)
            a = a_dc + (_sum(a_ac, fx, fy, 5, 5) if has_alpha else 0.0)
            r, g, b = lpq_to_rgb(lum, p, q)
            i = (y * w + x) * 4
            out[i : i + 4] = bytes(int(max(0.0, 255 * min(1.0, v))) for v in (r, g, b, a))
    return w, h, bytes(out)


def png_data_uri(placeholder: str) -> str:
    """The placeholder (base64 ThumbHash) as a `data:image/png;base64,...` URI."""
    w, h, rgba = to_rgba(base64.b64decode(placeholder + "=" * (-len(placeholder) % 4)))
    buffer = io.BytesIO()
    Image.frombytes("RGBA", (w, h), rgba).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


class _Nibbles:
    """The hash's 4-bit AC factors, read in order from byte `start`."""

    def __init__(self, data: bytes, start: int) -> None:
        self.data, self.start, self.index = data, start, 0

    def channel(self, nx: int, ny: int, scale: float) -> list[float]:
        ac = []
        for cy in range(ny):
            cx = 0 if cy else 1
            while cx * ny < nx * (ny - cy):
                byte = self.data[self.start + (self.index >> 1)]
                nibble = (byte >> ((self.index & 1) << 2)) & 15
                ac.append((nibble / 7.5 - 1) * scale)
                self.index += 1
                cx += 1
        return ac


def _sum(ac: list[float], fx: list[float], fy: list[float], nx: int, ny: int) -> float:
    """Σ ac[j] · fx[cx] · 2 fy[cy] over the triangle of terms the encoder keeps."""
    total, j = 0.0, 0
    for cy in range(ny):
        cx = 0 if cy else 1
        while cx * ny < nx * (ny - cy):
            total += ac[j] * fx[cx] * fy[cy] * 2
            j += 1
            cx += 1
    return total


def _round(value: float) -> int:
    """JavaScript's Math.round (halves up)."""
    return math.floor(value + 0.5)
