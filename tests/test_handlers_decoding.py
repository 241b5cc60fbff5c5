"""What escapes a decoder, codecs a backend lacks, and CIELAB TIFF (issue 11, defects 4-5).

Case tables live in tests/imagegen.py (tiff_offsets_*, tiff_jpeg2000, tiff_cielab run on
both backends in test_handlers.py and through `derivd run` in test_hostile.py); this
module holds what differs per backend and the shared guard itself.
"""

from __future__ import annotations

import io
import struct

import imagegen
import pytest
from PIL import Image, ImageChops, ImageStat
from test_handlers import MISTAKE_MAD, PARITY_MAD, SPEC, mad, reference

from derivd.handlers.base import (
    CorruptContent,
    Handler,
    Permanent,
    Transient,
    UnsupportedContent,
    decoding,
    target_size,
)
from derivd.handlers.registry import create_handler


@pytest.fixture(scope="module")
def both() -> dict[str, Handler]:
    return {name: create_handler(name, SPEC) for name in ("vips", "pillow")}


# --- the guard -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [TypeError("x"), OverflowError("x"), struct.error("x"), IndexError("x"), KeyError("x"),
     EOFError("x"), SyntaxError("x"), OSError("x"), ValueError("x"), RecursionError("x")],
    ids=lambda e: type(e).__name__,
)  # fmt: skip
def test_anything_escaping_a_decoder_is_corrupt_content(error: Exception) -> None:
    with pytest.raises(CorruptContent, match=type(error).__name__), decoding():
        raise error


def test_memory_error_is_a_resource_limit() -> None:
    with pytest.raises(Permanent) as caught, decoding():
        raise MemoryError
    assert caught.value.code == "resource_limit"


@pytest.mark.parametrize("outcome", [UnsupportedContent("u"), Transient("t")])
def test_outcomes_pass_through_unchanged(outcome: Exception) -> None:
    with pytest.raises(type(outcome)) as caught, decoding():
        raise outcome
    assert caught.value is outcome


def test_the_pillow_type_error_is_real() -> None:
    """The case really makes Pillow raise TypeError (not one of its documented errors)."""
    im = Image.open(io.BytesIO(imagegen.tiff_offsets_float()), formats=["TIFF"])
    with pytest.raises(TypeError):
        im.load()


# --- codecs --------------------------------------------------------------------------------


def test_lzma_tiff_is_unsupported_on_vips_and_derived_by_pillow(both: dict[str, Handler]) -> None:
    """The file is valid (Pillow's libtiff decodes it to what the uncompressed strip gives);
    libvips' bundled libtiff lacks LZMA: `unsupported_content`, never `corrupt_content`."""
    data = imagegen.tiff_lzma()
    with pytest.raises(UnsupportedContent):
        both["vips"].derive(data, SPEC)
    plain = imagegen.raw_tiff(64, 48, imagegen.scene(64, 48).tobytes())
    pillow = both["pillow"]
    assert mad(pillow.derive(data, SPEC)[0].data, pillow.derive(plain, SPEC)[0].data) == 0


# --- CIELAB --------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["vips", "pillow"])
def test_cielab_tiff_shows_the_scene(both: dict[str, Handler], backend: str) -> None:
    """Both backends read 8-bit CIELAB as D50 Lab: the picture comes back as the sRGB scene
    it was made from (libvips' own D65 Lab conversion is off by ~3 levels per channel)."""
    out = both[backend].derive(imagegen.tiff_cielab(), SPEC)[1]
    assert mad(out.data, reference(*target_size(imagegen.W, imagegen.H, 320))) <= PARITY_MAD


def test_cielab_read_as_rgb_would_be_a_visible_mistake() -> None:
    """The metric can tell: the Lab samples shown as if they were RGB are far off."""
    lab = Image.open(io.BytesIO(imagegen.tiff_cielab()))
    as_rgb = Image.frombytes("RGB", lab.size, lab.tobytes()).convert("RGBA")
    scene = imagegen.scene().convert("RGBA")
    assert max(ImageStat.Stat(ImageChops.difference(as_rgb, scene)).mean) > MISTAKE_MAD
