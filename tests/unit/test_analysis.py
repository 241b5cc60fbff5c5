"""The analysis of an original (handlers/analysis.py): its pure functions, and what both
backends hand back in `Derivation.original` for generated inputs of every format.

Backend agreement (the documented tolerance): `width`, `height`, `format`, `frames` and
`has_alpha` are equal; `colour` within COLOUR_LEVELS per channel (each backend shrinks
with its own resampler; measured 0-2), except unprofiled CMYK, which the backends render
differently (test_handlers.CMYK_UNPROFILED); `dhash` within DHASH_PARITY_BITS (measured
0-2); the placeholder's mean colour within PLACEHOLDER_DC of each other (measured 0 but
for CMYK and AVIF's decoders).
"""

from __future__ import annotations

import base64
import io

import imagegen
import pytest
from fixtures.analysis import average_rgb, hamming
from fixtures.pixels import BACKENDS, CMYK_UNPROFILED, READY_CASES, SPEC
from PIL import Image, ImageStat

from derivd.handlers.analysis import (
    SMALL_EDGE,
    Small,
    analyse,
    dhash,
    mean_colour,
    rgba_of,
    thumbhash,
    whole_blocks,
)
from derivd.handlers.base import Analysis, Derivation, Handler
from derivd.handlers.pillow import small_copy as pillow_small_copy

COLOUR_LEVELS = 2
DHASH_PARITY_BITS = 4
PLACEHOLDER_DC = 0.03
# The bounds: a re-encode at half size stays within 6 bits, unrelated photos
# differ by 16 or more; the placeholder's mean within 10 % of the image's mean colour.
SAME_PICTURE_BITS = 6
UNRELATED_BITS = 16
DC_FRACTION = 0.10


def pattern(width: int, height: int, alpha: bool) -> Small:
    """The image the reference vectors below were computed on (evanw/thumbhash's JS,
    npm thumbhash 0.1.1, rgbaToThumbHash). The offsets keep every AC term kept at least
    3e-4 from zero: without them the 32 x 24 one has a term that is zero in exact
    arithmetic, whose nibble (7 or 8) the reference's rounding noise decides."""
    px = bytearray()
    for y in range(height):
        for x in range(width):
            px += bytes([(x * 7 + y * 3 + 2) % 256, (x * x + y) % 256, (y * 11 + 10) % 256,
                         (x * 5 + y * y * 3 + 40) % 256 if alpha else 255])  # fmt: skip
    return Small(width, height, bytes(px))


def small_of(image: Image.Image) -> Small:
    return pillow_small_copy(image)  # what the Pillow backend hands the analysis


# --- the pure functions --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("width", "height", "alpha", "expected"),
    [(32, 24, False, "3jcKTYRAd4lheHiGh4eHdlJ/CX1B"),
     (24, 32, True, "HDiGLAQIYEeIN3mIGXX39oI3bHdyaAEzBQ==")],
)  # fmt: skip
def test_thumbhash_matches_the_reference_encoder(
    width: int, height: int, alpha: bool, expected: str
) -> None:
    """Byte for byte what rgbaToThumbHash (js/thumbhash.js) returns for the same pixels.
    (An AC term that is exactly zero lands on a rounding tie, which the reference leaves
    to float summation order and derivd rounds as zero: the patterns avoid those.)"""
    assert base64.b64encode(thumbhash(pattern(width, height, alpha))).decode() == expected


def test_small_refuses_what_thumbhash_cannot_take() -> None:
    with pytest.raises(ValueError):
        Small(101, 10, bytes(101 * 10 * 4))
    with pytest.raises(ValueError):
        Small(2, 2, bytes(15))


@pytest.mark.parametrize(("width", "height"), [(31, 23), (32, 24), (17, 32), (29, 7), (32, 21)])
@pytest.mark.parametrize("level", [77, 128, 200])
def test_a_flat_image_has_no_difference_bits_and_no_varying_terms(
    width: int, height: int, level: int
) -> None:
    """Ties are not left to the last bits of the sums: the pure-Python port gave these
    flat greys dhashes with up to 20 bits set and ThumbHash AC terms of rounding noise
    (13 of these 15 sizes and levels)."""
    flat = Small(width, height, bytes([level, level, level, 255]) * (width * height))
    assert dhash(flat) == 0
    hashed = thumbhash(flat)
    header24 = int.from_bytes(hashed[:3], "little")
    assert (header24 >> 18) & 31 == 0  # the luminance AC scale
    assert hashed[3] >> 3 == 0 and hashed[4] & 0x7F == 0  # the P and Q AC scales
    assert set(hashed[5:]) == {0}  # no AC term


@pytest.mark.parametrize(
    ("size", "factors"),
    [((720, 588), (23, 23)), ((32, 20), (1, 1)), ((33, 33), (2, 2)), ((1, 5000), (1, 157)),
     ((5000, 3), (157, 3)), ((4032, 3024), (126, 126))],
)  # fmt: skip
def test_the_whole_blocks_bring_the_long_edge_to_32_px_or_under(
    size: tuple[int, int], factors: tuple[int, int]
) -> None:
    width, height = size
    blocks = whole_blocks(width, height)
    assert (blocks.across, blocks.down) == factors
    assert max(width // factors[0], height // factors[1]) <= SMALL_EDGE
    # The area they fill whole: at most one partial block less on each side.
    assert (blocks.width % blocks.across, blocks.height % blocks.down) == (0, 0)
    assert 0 <= width - blocks.width < blocks.across
    assert 0 <= height - blocks.height < blocks.down


@pytest.mark.parametrize("size", [(637, 401), (33, 47), (1, 300), (100, 100)])
def test_both_backends_hand_the_analysis_the_same_blocks(
    both: dict[str, Handler], size: tuple[int, int]
) -> None:
    """Whole blocks, the partial ones left out: the same small copy size, and the same
    mean of the same pixels (one colour per block column: no resampler can blur it)."""
    width, height = size
    stripes = Image.new("RGB", size)
    stripes.putdata([((x * 37) % 256, (x * 11) % 256, 90) for _ in range(height)
                     for x in range(width)])  # fmt: skip
    buf = io.BytesIO()
    stripes.save(buf, "PNG")
    got = {b: Derivation.of(both[b].derive(buf.getvalue(), SPEC)).original for b in BACKENDS}
    vips, pillow = (got[b] for b in BACKENDS)
    assert vips is not None and pillow is not None
    assert vips.colour == pillow.colour
    assert vips.dhash == pillow.dhash


def test_dhash_is_a_signed_64_bit_integer() -> None:
    # Brighter on the left everywhere: every bit set, which is -1 as a signed bigint.
    ramp = Image.linear_gradient("L").rotate(90).convert("RGB")  # black left, white right
    assert dhash(small_of(ramp)) == 0
    assert dhash(small_of(ramp.transpose(Image.Transpose.FLIP_LEFT_RIGHT))) == -1
    assert hamming(-1, 0) == 64


def test_mean_colour_weights_by_alpha() -> None:
    half = Image.new("RGBA", (10, 10), (255, 0, 0, 255))
    half.paste((0, 0, 255, 0), (5, 0, 10, 10))  # invisible blue must not count
    assert mean_colour(small_of(half)) == "#ff0000"


def test_mean_colour_of_an_opaque_image_is_its_plain_mean() -> None:
    """Opaque pixels take the unweighted path (the reference vectors above cover ThumbHash's
    own: `pattern(..., alpha=False)` is opaque)."""
    small = small_of(imagegen.scene(32, 24))
    rgb = Image.frombytes("RGBA", (small.width, small.height), small.rgba).convert("RGB")
    expected = "#" + "".join(f"{round(v):02x}" for v in ImageStat.Stat(rgb).mean)
    assert mean_colour(small) == expected


@pytest.mark.parametrize("mode", ["L", "LA", "RGB", "RGBA"])
def test_rgba_of_matches_pillows_conversion(mode: str) -> None:
    image = imagegen.scene(7, 5).convert(mode)
    if "A" in mode:
        image.putalpha(Image.linear_gradient("L").resize(image.size))
    expected = image.convert("RGBA").tobytes()
    assert rgba_of(image.tobytes(), len(mode)) == expected


def test_dhash_tells_the_same_picture_from_another() -> None:
    scene = imagegen.scene()
    half = scene.resize((scene.width // 2, scene.height // 2), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    half.save(buf, "JPEG", quality=75)
    again = Image.open(buf)
    assert hamming(dhash(small_of(scene)), dhash(small_of(again))) <= SAME_PICTURE_BITS
    other = imagegen.scene().rotate(180)
    assert hamming(dhash(small_of(scene)), dhash(small_of(other))) >= UNRELATED_BITS


def test_analyse_fills_every_field() -> None:
    got = analyse(pattern(32, 24, False), width=640, height=480, fmt="png", frames=1,
                  has_alpha=False)  # fmt: skip
    assert isinstance(got, Analysis)
    assert (got.width, got.height, got.format, got.frames, got.has_alpha) == (
        640, 480, "png", 1, False)  # fmt: skip
    assert got.colour.startswith("#") and len(got.colour) == 7
    assert -(2**63) <= got.dhash < 2**63
    assert base64.b64decode(got.placeholder)


# --- through the handlers ------------------------------------------------------------------


def channels(colour: str) -> tuple[int, int, int]:
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)


def check_placeholder_mean(original: Analysis, preview: bytes) -> None:
    """The placeholder's DC terms are the image's mean colour, within DC_FRACTION."""
    image = Image.open(io.BytesIO(preview)).convert("RGB")
    mean = ImageStat.Stat(image).mean
    dc = average_rgb(base64.b64decode(original.placeholder))
    for got, want in zip(dc, mean, strict=True):
        assert abs(got * 255 - want) <= DC_FRACTION * 255, (dc, mean)


@pytest.mark.parametrize(("name", "make"), READY_CASES, ids=[n for n, _ in READY_CASES])
def test_both_backends_agree_on_the_analysis(
    both: dict[str, Handler], name: str, make: imagegen.Factory
) -> None:
    data = make()
    results = {b: Derivation.of(both[b].derive(data, SPEC)) for b in BACKENDS}
    vips, pillow = (results[b].original for b in BACKENDS)
    assert vips is not None and pillow is not None
    shown = imagegen.DISPLAY_SIZE[name]
    assert (vips.width, vips.height) == shown
    assert (vips.width, vips.height, vips.format, vips.frames, vips.has_alpha) == (
        pillow.width, pillow.height, pillow.format, pillow.frames, pillow.has_alpha)  # fmt: skip
    assert vips.format == name.split("_")[0]
    assert hamming(vips.dhash, pillow.dhash) <= DHASH_PARITY_BITS
    if name not in CMYK_UNPROFILED:
        pairs = zip(channels(vips.colour), channels(pillow.colour), strict=True)
        assert all(abs(a - b) <= COLOUR_LEVELS for a, b in pairs), (vips.colour, pillow.colour)
        dcs = (average_rgb(base64.b64decode(o.placeholder)) for o in (vips, pillow))
        assert max(abs(a - b) for a, b in zip(*dcs, strict=True)) <= PLACEHOLDER_DC
    for backend in BACKENDS:
        original = results[backend].original
        assert original is not None
        if "alpha" not in name and "transparent" not in name and "rgba" not in name:
            assert not original.has_alpha
        if not original.has_alpha:  # with alpha the preview's mean counts invisible colour
            check_placeholder_mean(original, results[backend][0].data)


@pytest.mark.parametrize("name", ["png_rgba", "webp_alpha", "png_grey_alpha"])
def test_alpha_is_reported(both: dict[str, Handler], name: str) -> None:
    for handler in both.values():
        original = Derivation.of(handler.derive(imagegen.case(name), SPEC)).original
        assert original is not None and original.has_alpha
