"""Both image backends at handler level (no database, no storage), on generated inputs.

Pixel comparisons use `mad` (tests/support/fixtures/pixels.py says what it measures).
"""

from __future__ import annotations

import io

import imagegen
import pytest
from fixtures.pixels import (
    BACKENDS,
    CMYK_UNPROFILED,
    MISTAKE_MAD,
    PARITY_MAD,
    READY_CASES,
    SPEC,
    decode,
    mad,
    reference,
    riff_chunks,
)
from PIL import Image, ImageCms

from derivd.handlers.base import (
    DerivedVariant,
    DeriveSpec,
    Handler,
    Permanent,
    target_size,
)
from derivd.handlers.registry import create_handler

# Same picture through a different EXIF orientation (different JPEG block grid, so a
# different set of compression errors). Measured: 1.2-1.9.
ORIENTATION_MAD = 4.0
ALPHA_CASES = {"png_rgba", "png_palette_transparent", "png_grey_alpha", "png_rgba_p3",
               "webp_alpha"}  # fmt: skip
REJECT_CASES = [(n, make, expected) for n, make, expected in imagegen.CASES if expected != "ready"]


# --- helpers ---------------------------------------------------------------------------------


def expected_sizes(name: str) -> list[tuple[int, int]]:
    width, height = imagegen.DISPLAY_SIZE[name]
    return [target_size(width, height, v.long_edge) for v in SPEC.variants]


# --- every case, both backends ------------------------------------------------------------


@pytest.mark.parametrize(("name", "make"), READY_CASES, ids=[n for n, _ in READY_CASES])
def test_ready_case(handler: Handler, name: str, make: imagegen.Factory) -> None:
    out = handler.derive(make(), SPEC)

    assert [v.name for v in out] == [v.name for v in SPEC.variants]
    assert [(v.width, v.height) for v in out] == expected_sizes(name)
    for variant in out:
        assert variant == DerivedVariant.of(variant.name, variant.data, variant.width,
                                            variant.height)  # fmt: skip
        assert variant.content_type == "image/webp"
        with Image.open(io.BytesIO(variant.data)) as im:
            assert (im.format, im.size) == ("WEBP", (variant.width, variant.height))
            assert not getattr(im, "is_animated", False)
        # Metadata stripped after colour conversion: no ICC, EXIF or XMP chunk.
        assert not {b"ICCP", b"EXIF", b"XMP "} & set(riff_chunks(variant.data))


@pytest.mark.parametrize(
    ("name", "make", "code"), REJECT_CASES, ids=[n for n, _, _ in REJECT_CASES]
)
def test_rejected_case(handler: Handler, name: str, make: imagegen.Factory, code: str) -> None:
    with pytest.raises(Permanent) as caught:
        handler.derive(make(), SPEC)
    assert caught.value.code == code


# --- limits ----------------------------------------------------------------------------------


def _spec(**limits: int) -> DeriveSpec:
    return DeriveSpec(variants=SPEC.variants, **limits)


@pytest.mark.parametrize("backend", BACKENDS)
def test_limits_are_inclusive_and_exact(backend: str) -> None:
    """At the limit derives, one below rejects: the checks use the real header values."""
    data = imagegen.jpeg()
    pixels = imagegen.W * imagegen.H
    handler = create_handler(backend, SPEC)
    handler.derive(data, _spec(max_pixels=pixels, max_input_bytes=len(data)))
    for limits in ({"max_pixels": pixels - 1}, {"max_input_bytes": len(data) - 1}):
        with pytest.raises(Permanent) as caught:
            handler.derive(data, _spec(**limits))
        assert caught.value.code == "resource_limit", limits


@pytest.mark.parametrize("backend", BACKENDS)
def test_frames_count_against_both_limits(backend: str) -> None:
    data = imagegen.gif_animated()  # 5 frames of 240 x 180
    handler = create_handler(backend, SPEC)
    handler.derive(data, _spec(max_frames=5, max_pixels=240 * 180 * 5))
    for limits in ({"max_frames": 4}, {"max_pixels": 240 * 180 * 5 - 1}):
        with pytest.raises(Permanent) as caught:
            handler.derive(data, _spec(**limits))
        assert caught.value.code == "resource_limit", limits


# --- what the pixels must look like ---------------------------------------------------------


@pytest.mark.parametrize("fmt", ["gif_animated", "webp_animated"])
def test_animation_gives_its_first_frame(handler: Handler, fmt: str) -> None:
    out = handler.derive(imagegen.case(fmt), SPEC)
    first = Image.new("RGBA", (out[0].width, out[0].height), (*imagegen.FIRST_FRAME_RGB, 255))
    assert mad(out[0].data, first) < PARITY_MAD


@pytest.mark.parametrize("n", range(2, 9))
def test_exif_orientation_applied(handler: Handler, n: int) -> None:
    upright = handler.derive(imagegen.jpeg_orientation(1), SPEC)
    turned = handler.derive(imagegen.jpeg_orientation(n), SPEC)
    for a, b in zip(upright, turned, strict=True):
        assert (a.width, a.height) == (b.width, b.height)
        assert mad(a.data, b.data) <= ORIENTATION_MAD
    # The metric can tell: the same output mirrored is far off.
    mirrored = decode(turned[0].data).transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    assert mad(upright[0].data, mirrored) > MISTAKE_MAD


@pytest.mark.parametrize("name", ["jpeg_bad_exif", "jpeg_orientation_9"])
def test_junk_orientation_means_upright(handler: Handler, name: str) -> None:
    upright = handler.derive(imagegen.jpeg_orientation(1), SPEC)
    junk = handler.derive(imagegen.case(name), SPEC)
    assert mad(upright[0].data, junk[0].data) <= ORIENTATION_MAD


# With alpha, premultiplication scales every difference by the alpha ramp (mean ~0.45).
@pytest.mark.parametrize(
    ("tagged", "plain", "least"),
    [("png_p3", "png_rgb", MISTAKE_MAD), ("png_rgba_p3", "png_rgba", MISTAKE_MAD * 0.45)],
)
def test_embedded_profile_is_converted_to_srgb(
    handler: Handler, tagged: str, plain: str, least: float
) -> None:
    """Display P3 values shown as sRGB must change; ignoring the profile would not."""
    converted = handler.derive(imagegen.case(tagged), SPEC)[0].data
    untagged = handler.derive(imagegen.case(plain), SPEC)[0].data
    assert mad(converted, untagged) > least


def test_p3_conversion_is_the_same_on_both_backends(both: dict[str, Handler]) -> None:
    outs = [h.derive(imagegen.png_p3(), SPEC)[0].data for h in both.values()]
    assert mad(*outs) <= PARITY_MAD


@pytest.mark.parametrize(
    ("deep", "flat"),
    [("png_grey16", "png_grey"), ("png_rgb16", "png_rgb")],
)
def test_deep_and_cmyk_inputs_look_like_the_plain_ones(
    handler: Handler, deep: str, flat: str
) -> None:
    """16-bit is scaled to 8 bits, not clipped (clipping would turn most of it white)."""
    a = handler.derive(imagegen.case(deep), SPEC)[0].data
    b = handler.derive(imagegen.case(flat), SPEC)[0].data
    assert mad(a, b) <= PARITY_MAD


@pytest.mark.parametrize("name", sorted(ALPHA_CASES))
def test_alpha_is_kept(handler: Handler, name: str) -> None:
    for variant in handler.derive(imagegen.case(name), SPEC):
        im = Image.open(io.BytesIO(variant.data)).convert("RGBA")
        alpha = im.getchannel("A")
        assert alpha.getpixel((0, 0)) == 0  # the transparent corner
        assert alpha.getextrema()[1] == 255


def test_profiled_cmyk_goes_through_its_profile(handler: Handler) -> None:
    """The reference is the scene sent through the same profile and back with LittleCMS
    directly (the CMYK gamut clips some colours, so it is not the scene itself)."""
    srgb = ImageCms.createProfile("sRGB")
    cmyk = ImageCms.ImageCmsProfile(io.BytesIO(imagegen._cmyk_profile()))
    there = ImageCms.profileToProfile(imagegen.scene(), srgb, cmyk, outputMode="CMYK")
    assert there is not None
    relative = ImageCms.Intent.RELATIVE_COLORIMETRIC  # the handlers' intent
    back = ImageCms.profileToProfile(there, cmyk, srgb, relative, outputMode="RGB")
    assert back is not None
    out = handler.derive(imagegen.jpeg_cmyk_icc(), SPEC)[0]
    assert mad(out.data, back.convert("RGBA")) <= PARITY_MAD
    assert mad(out.data, imagegen.scene().convert("RGBA")) > MISTAKE_MAD  # it does clip


def test_unprofiled_cmyk_pillow_is_naive_and_vips_is_managed(both: dict[str, Handler]) -> None:
    """The one documented divergence (see CMYK_UNPROFILED): each backend is consistent
    with itself, and the generator's naive RGB->CMYK round-trips exactly through Pillow."""
    scene = reference(*target_size(imagegen.W, imagegen.H, 320))
    for name in sorted(CMYK_UNPROFILED):
        pillow = both["pillow"].derive(imagegen.case(name), SPEC)[1].data
        vips = both["vips"].derive(imagegen.case(name), SPEC)[1].data
        assert mad(pillow, scene) <= PARITY_MAD
        assert mad(vips, scene) > PARITY_MAD  # profile-managed: a different rendering


# --- backend parity --------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "make"), READY_CASES, ids=[n for n, _ in READY_CASES])
def test_backend_parity(both: dict[str, Handler], name: str, make: imagegen.Factory) -> None:
    """Same variant names and dimensions, and pixels within PARITY_MAD (module docstring),
    except the colour of unprofiled CMYK (CMYK_UNPROFILED)."""
    data = make()
    vips, pillow = (both[b].derive(data, SPEC) for b in BACKENDS)
    assert [(v.name, v.width, v.height) for v in vips] == [
        (v.name, v.width, v.height) for v in pillow
    ]
    if name not in CMYK_UNPROFILED:
        for a, b in zip(vips, pillow, strict=True):
            assert mad(a.data, b.data) <= PARITY_MAD, a.name


@pytest.mark.parametrize("size", [(1, 1), (3, 2000), (2000, 3), (1601, 1067), (1600, 1599)])
def test_parity_of_rounding_at_awkward_sizes(both: dict[str, Handler], size: tuple[int, int]
                                             ) -> None:  # fmt: skip
    """libvips' own fit rounds some short edges differently; the handlers must not."""
    data = imagegen.jpeg(*size)
    results = [[(v.width, v.height) for v in both[b].derive(data, SPEC)] for b in BACKENDS]
    expected = [target_size(*size, v.long_edge) for v in SPEC.variants]
    assert results == [expected, expected]
