"""HDR video (PQ, HLG; BT.2020) to 8-bit sRGB, on the small base a preview needs.

A PQ or HLG frame read as if it were SDR looks grey and flat ("washed out"): its code
values spend most of their range below SDR's white. Here the signal becomes light first
(`pq_to_nits`, `hlg_to_nits`: ITU-R BT.2100's EOTFs, HLG's with its OOTF at a
1000-nit display), relative to SDR's reference white (203 nits, ITU-R BT.2408), then
BT.2020's primaries become BT.709's (sRGB's) in linear light, then `compress`
leaves everything below a knee as it is and rolls the highlights off towards white
(on the largest of R, G, B, which keeps hue and never clips one channel alone), then the
sRGB curve and 8 bits. Pure numpy on arrays the caller passes in.
"""

from __future__ import annotations

from typing import Any

from derivd.handlers.lazy_numpy import numpy

SDR_WHITE_NITS = 203.0  # BT.2408: HDR reference white, drawn as SDR's white
HLG_PEAK_NITS = 1000.0  # the display BT.2100's HLG OOTF assumes here (system gamma 1.2)
KNEE = 0.8  # below this (of SDR white) light passes unchanged; above, it rolls off

# ITU-R BT.2100 PQ constants.
_M1, _M2 = 2610 / 16384, 2523 / 4096 * 128
_C1, _C2, _C3 = 3424 / 4096, 2413 / 4096 * 32, 2392 / 4096 * 32
# HLG constants.
_A = 0.17883277
_B = 1 - 4 * _A
_C = 0.55991073  # 0.5 - a ln(4a)
# Linear BT.2020 RGB to linear BT.709 RGB (ITU-R BT.2087).
BT2020_TO_BT709 = (
    (1.6605, -0.5876, -0.0728),
    (-0.1246, 1.1329, -0.0083),
    (-0.0182, -0.1006, 1.1187),
)
_BT2020_LUMA = (0.2627, 0.6780, 0.0593)


def pq_to_nits(signal: Any) -> Any:
    """PQ code values (0-1) to absolute light, in nits."""
    np = numpy()
    power = np.power(np.clip(signal, 0.0, 1.0), 1 / _M2)
    return 10000.0 * np.power(np.maximum(power - _C1, 0.0) / (_C2 - _C3 * power), 1 / _M1)


def hlg_to_nits(signal: Any) -> Any:
    """HLG code values (0-1, R'G'B' last axis) to display light in nits (inverse OETF,
    then the OOTF at HLG_PEAK_NITS: gamma 1.2 on the scene's luminance)."""
    np = numpy()
    e = np.clip(signal, 0.0, 1.0)
    scene = np.where(e <= 0.5, e * e / 3, (np.exp((e - _C) / _A) + _B) / 12)
    luma = np.maximum(scene @ np.array(_BT2020_LUMA), 1e-6)[..., None]
    return HLG_PEAK_NITS * np.power(luma, 0.2) * scene


def compress(relative: Any) -> Any:
    """Light relative to SDR white, RGB on the last axis, to 0-1: unchanged up to KNEE
    (on the largest channel), then rolled off smoothly (slope 1 at the knee) towards 1."""
    np = numpy()
    peak = np.maximum(relative.max(axis=-1, keepdims=True), 1e-6)
    over = np.maximum(peak - KNEE, 0.0)
    rolled = KNEE + (1 - KNEE) * (1 - np.exp(-over / (1 - KNEE)))
    mapped = np.where(peak > KNEE, rolled, peak)
    return np.clip(relative * (mapped / peak), 0.0, 1.0)


def srgb_encode(linear: Any) -> Any:
    np = numpy()
    return np.where(linear <= 0.0031308, linear * 12.92, 1.055 * np.power(linear, 1 / 2.4) - 0.055)


def to_sdr(rgb16: Any, transfer: str) -> Any:
    """16-bit BT.2020 R'G'B' (height x width x 3, full range) in `transfer` (`pq` or
    `hlg`) to 8-bit sRGB (height x width x 3, uint8)."""
    np = numpy()
    signal = rgb16.astype(np.float32) / 65535.0
    nits = pq_to_nits(signal) if transfer == "pq" else hlg_to_nits(signal)
    linear = np.maximum(nits / SDR_WHITE_NITS @ np.array(BT2020_TO_BT709, np.float32).T, 0.0)
    encoded = srgb_encode(compress(linear))
    return np.rint(encoded * 255.0).astype(np.uint8)
