"""Shrink-on-load (`[derive] shrink_on_load`): the rule both backends share, that the vips
backend really decodes less, and that what `fast` saves is not visible: SSIM >= 0.98
against the same backend's full decode (`off`) on a photo-like original with grain."""

from __future__ import annotations

import io
from dataclasses import replace
from functools import cache

import pytest
import pyvips
from fidelity import ssim
from imagegen import scene
from PIL import Image

from derivd.handlers.base import DeriveSpec, VariantSpec
from derivd.handlers.geometry import base_size, jpeg_shrink, webp_scale
from derivd.handlers.registry import create_handler
from derivd.handlers.vips_variants import open_shrunk

COVER = VariantSpec("bench", box=(720, 588), fit="cover", formats=("png",))
INSIDE = VariantSpec("preview", long_edge=800, formats=("png",))
THUMB = VariantSpec("thumb", long_edge=320, formats=("png",))


@pytest.mark.parametrize(
    ("original", "base", "fast", "safe"),
    [
        ((2725, 2225), (720, 588), 2, 1),  # sharp's fixture: shrink 3.78
        ((4032, 3024), (784, 588), 4, 2),  # a phone photo to a 720x588 cover: 5.14
        ((3024, 4032), (720, 960), 2, 2),  # 4.2: 4 equals its integer part, lowered
        ((6000, 4000), (666, 444), 8, 4),  # 9.0
        ((4000, 4000), (500, 500), 4, 4),  # exactly 8: lowered from 8
        ((800, 600), (784, 588), 1, 1),  # barely any shrink
    ],
)
def test_jpeg_shrink_is_sharps_rule(
    original: tuple[int, int], base: tuple[int, int], fast: int, safe: int
) -> None:
    assert jpeg_shrink(original, base, "fast") == fast
    assert jpeg_shrink(original, base, "safe") == safe
    assert jpeg_shrink(original, base, "off") == 1
    # However the decoder rounds a scaled side, the decoded image covers the base.
    for factor in (fast, safe):
        assert original[0] // factor >= base[0] and original[1] // factor >= base[1]


def test_webp_scale_fast_reaches_the_base_safe_leaves_two() -> None:
    assert webp_scale((4000, 3000), (800, 600), "fast") == pytest.approx(0.2)
    assert webp_scale((4000, 3000), (800, 600), "safe") == pytest.approx(0.4)
    assert webp_scale((4000, 3000), (800, 600), "off") == 1.0
    assert webp_scale((900, 600), (800, 600), "safe") == 1.0  # never up


@cache
def photo(fmt: str = "JPEG", size: tuple[int, int] = (2725, 2225)) -> bytes:
    """A photo-like original: the generated scene with grain (fine detail is where a
    shrink-on-load shows first)."""
    picture = scene(*size)
    grain = Image.effect_noise(size, 24).convert("RGB")
    buf = io.BytesIO()
    Image.blend(picture, grain, 0.2).save(buf, fmt, quality=90)
    return buf.getvalue()


def test_vips_fast_decodes_the_fixture_at_half_size() -> None:
    original = photo()
    base = base_size(2725, 2225, (COVER,))
    shrunk = open_shrunk(original, "jpegload_buffer", (2725, 2225), base, "fast")
    assert shrunk is not None and (shrunk.width, shrunk.height) == (1362, 1112)
    full = open_shrunk(original, "jpegload_buffer", (2725, 2225), base, "off")
    assert full is not None and (full.width, full.height) == (2725, 2225)
    assert open_shrunk(original, "pngload_buffer", (2725, 2225), base, "fast") is None


def _derive(backend: str, original: bytes, variants: tuple[VariantSpec, ...], mode: str
            ) -> list[bytes]:  # fmt: skip
    spec = replace(DeriveSpec(variants=variants, concurrency=1), shrink_on_load=mode)
    return [bytes(v.data) for v in create_handler(backend, spec).derive(original, spec)]


@pytest.mark.parametrize("backend", ["vips", "pillow"])
@pytest.mark.parametrize("fmt", ["JPEG", "WEBP"])
@pytest.mark.parametrize("mode", ["fast", "safe"])
def test_shrink_on_load_is_not_visible(backend: str, fmt: str, mode: str) -> None:
    """Every variant of a set (a cover and two insides of different scales, so the base
    is larger than some of them) within SSIM 0.98 of the full decode, and the same size."""
    original = photo(fmt)
    variants = (COVER, INSIDE, THUMB)
    fast = _derive(backend, original, variants, mode)
    full = _derive(backend, original, variants, "off")
    for made, reference in zip(fast, full, strict=True):
        size = pyvips.Image.new_from_buffer(made, "").width
        assert size == pyvips.Image.new_from_buffer(reference, "").width
        assert ssim(reference, made) >= 0.98


@cache
def sideways_photo() -> bytes:
    """A portrait phone photo as phones store it: landscape pixels, EXIF orientation 6,
    sides that 2 does not divide (the decoded image has a partial last pixel)."""
    picture = scene(1511, 2013).transpose(Image.Transpose.ROTATE_90)
    grain = Image.effect_noise(picture.size, 24).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.blend(picture, grain, 0.2).save(buf, "JPEG", quality=90, exif=exif.tobytes())
    return buf.getvalue()


@pytest.mark.parametrize("backend", ["vips", "pillow"])
def test_a_sideways_photo_is_turned_after_the_shrink(backend: str) -> None:
    """Oriented after the resize (Pillow turns the small base, not the decoded original):
    upright, the same size and within SSIM 0.98 of the full decode, and of the other
    backend."""
    original = sideways_photo()
    cover = (VariantSpec("small", box=(320, 240), fit="cover", formats=("png",)),)
    assert jpeg_shrink((1511, 2013), base_size(1511, 2013, cover), "fast") == 2
    (fast,) = _derive(backend, original, cover, "fast")
    (full,) = _derive(backend, original, cover, "off")
    (other,) = _derive("pillow" if backend == "vips" else "vips", original, cover, "fast")
    upright = Image.open(io.BytesIO(fast))
    assert upright.size == Image.open(io.BytesIO(full)).size == (320, 240)
    assert ssim(full, fast) >= 0.98
    assert ssim(other, fast) >= 0.98


@pytest.mark.parametrize("backend", ["vips", "pillow"])
def test_fast_decodes_jpeg_differently_from_the_full_decode(backend: str) -> None:
    """The SSIM check above would pass trivially if `fast` decoded at full size too (as it
    does for WebP on Pillow, which has no scaled WebP decode)."""
    original = photo()
    variants = (COVER, INSIDE, THUMB)
    fast = _derive(backend, original, variants, "fast")
    full = _derive(backend, original, variants, "off")
    assert all(a != b for a, b in zip(fast, full, strict=True))
