"""Variants beyond the long-edge WebP: boxes, cover crops, formats, animation, one decode.

Handler level (no database, no storage), both backends. Pixel comparisons use `mad` from
test_handlers (worst-channel mean absolute difference, premultiplied); formats other than
WebP are decoded by Pillow for it.
"""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys

import imagegen
import pytest
from fixtures.cli import SUPPORT
from fixtures.corpus import CORPUS
from fixtures.pixels import PARITY_MAD
from PIL import Image, ImageChops, ImageDraw, ImageStat

from derivd.config import SupervisorSettings
from derivd.handlers.base import (
    AVIF_MAX_PIXELS,
    DeriveSpec,
    Handler,
    ResourceLimit,
    VariantSpec,
)
from derivd.handlers.geometry import output_size
from derivd.handlers.outputs import avif_quality
from derivd.handlers.registry import create_handler

BACKENDS = ("vips", "pillow")
MAGIC = {"webp": "WEBP", "avif": "AVIF", "jpeg": "JPEG", "png": "PNG"}
CONTENT_TYPES = {"webp": "image/webp", "avif": "image/avif", "jpeg": "image/jpeg",
                 "png": "image/png"}  # fmt: skip

EVERY_OPTION = (
    VariantSpec("preview", 1600),
    VariantSpec("card", box=(300, 158), fit="cover", formats=("jpeg", "webp")),
    VariantSpec("avatar", box=(96, 96), fit="cover", gravity="attention"),
    VariantSpec("square", box=(120, 120), fit="cover", gravity="entropy", formats=("png",)),
    VariantSpec("boxed", box=(200, 50), formats=("avif",), quality=50),
    VariantSpec("lossless", 64, lossless=True),
    VariantSpec("big", box=(900, 900), upscale=True),
)
SPEC = DeriveSpec(variants=EVERY_OPTION)
# One variant in two formats: two different lossy encoders on the same pixels, each about
# 1-3 off on small, busy crops (measured up to 4.1 for an 80 x 80 crop); a wrong colour
# conversion or channel order is 10+ off.
FORMAT_MAD = 6.0


def decode(data: bytes) -> Image.Image:
    """Premultiplied RGBA of any output format."""
    rgba = Image.open(io.BytesIO(data)).convert("RGBA")
    alpha = rgba.getchannel("A")
    colour = Image.composite(rgba.convert("RGB"), Image.new("RGB", rgba.size), alpha)
    return Image.merge("RGBA", (*colour.split(), alpha))


def mad(a: bytes, b: bytes) -> float:
    ia, ib = decode(a), decode(b)
    assert ia.size == ib.size
    return max(ImageStat.Stat(ImageChops.difference(ia, ib)).mean)


def spec_of(*variants: VariantSpec, **limits: int) -> DeriveSpec:
    return DeriveSpec(variants=variants, **limits)


# --- geometry and formats, both backends -----------------------------------------------------


@pytest.mark.parametrize("case", ["jpeg_baseline", "png_rgba", "jpeg_orientation_6",
                                  "webp_lossy", "tiff_cmyk"])  # fmt: skip
def test_every_option_same_dimensions_on_both_backends(both: dict[str, Handler], case: str
                                                       ) -> None:  # fmt: skip
    """Names, formats, dimensions identical, in the configured order (the primary first),
    each object what its Content-Type says; the same pixels within PARITY_MAD (apart from
    unprofiled CMYK, whose colour differs by design, see test_handlers)."""
    data = imagegen.case(case)
    upright = imagegen.DISPLAY_SIZE[case]
    expected = [(v.name, f, *output_size(*upright, v)) for v in EVERY_OPTION for f in v.formats]
    results = {b: both[b].derive(data, SPEC) for b in BACKENDS}
    for out in results.values():
        assert [(v.name, v.format, v.width, v.height) for v in out] == expected
        for v in out:
            with Image.open(io.BytesIO(v.data)) as im:
                assert (im.format, im.size) == (MAGIC[v.format], (v.width, v.height))
            assert v.content_type == CONTENT_TYPES[v.format]
    if case != "tiff_cmyk":
        for a, b in zip(results["vips"], results["pillow"], strict=True):
            if a.name not in ("avatar", "square"):  # smart crops: each backend its measure
                assert mad(a.data, b.data) <= PARITY_MAD, (a.name, a.format)


def test_cover_and_inside_geometry() -> None:
    cover = VariantSpec("c", box=(320, 320), fit="cover")
    assert output_size(1600, 900, cover) == (320, 320)
    assert output_size(200, 100, cover) == (200, 100)  # no upscale: what the image can fill
    assert output_size(1, 20000, cover) == (1, 320)
    assert output_size(1, 20000, VariantSpec("u", box=(320, 320), fit="cover", upscale=True)
                       ) == (320, 320)  # fmt: skip
    assert output_size(1600, 900, VariantSpec("i", box=(320, 320))) == (320, 180)
    assert output_size(100, 50, VariantSpec("i", box=(320, 320), upscale=True)) == (320, 160)
    assert output_size(100, 50, VariantSpec("i", 320)) == (100, 50)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("upscale", [False, True])
def test_a_1x20000_strip_covered_to_320x320(backend: str, upscale: bool) -> None:
    """The window is cut before any resize: an upscaled cover never builds the
    320 x 6 400 000 intermediate that resize-then-crop would."""
    data = imagegen._save(Image.new("RGB", (1, 20_000), (10, 200, 30)), "PNG")
    spec = spec_of(VariantSpec("c", box=(320, 320), fit="cover", upscale=upscale,
                               formats=("webp", "avif", "jpeg", "png")))  # fmt: skip
    out = create_handler(backend, spec).derive(data, spec)
    size = (320, 320) if upscale else (1, 320)
    assert [(v.width, v.height) for v in out] == [size] * 4
    for v in out:
        pixel = decode(v.data).getpixel((0, size[1] // 2))
        assert isinstance(pixel, tuple)
        assert abs(pixel[1] - 200) < 12, (v.format, pixel)


def _busy_right_half(width: int = 800, height: int = 300) -> bytes:
    """Flat grey on the left, saturated noise and edges on the right."""
    im = Image.new("RGB", (width, height), (128, 128, 128))
    draw, rng = ImageDraw.Draw(im), random.Random(7)
    for _ in range(600):
        x, y = rng.randrange(width // 2 + 20, width), rng.randrange(height)
        colour = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
        draw.rectangle((x, y, x + rng.randrange(4, 20), y + rng.randrange(4, 20)), fill=colour)
    return imagegen._save(im, "PNG")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gravity", ["attention", "entropy"])
def test_smart_crop_finds_the_busy_half(backend: str, gravity: str) -> None:
    spec = spec_of(VariantSpec("c", box=(200, 200), fit="cover", gravity=gravity),
                   VariantSpec("centre", box=(200, 200), fit="cover"))  # fmt: skip
    smart, centre = create_handler(backend, spec).derive(_busy_right_half(), spec)
    grey = (128, 128, 128, 255)
    flat = [decode(v.data).getpixel((20, 100)) for v in (smart, centre)]
    assert flat[1] == pytest.approx(grey, abs=3)  # the centre window starts on the flat half
    assert max(abs(a - b) for a, b in zip(flat[0], grey, strict=False)) > 20


# --- odd inputs through every format ---------------------------------------------------------

EVERY_FORMAT = spec_of(
    VariantSpec("v", 200, formats=("webp", "avif", "jpeg", "png")),
    VariantSpec("c", box=(80, 80), fit="cover", formats=("webp", "avif", "jpeg", "png")),
)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["jpeg_cmyk", "jpeg_cmyk_icc", "tiff_cmyk", "png_rgb16",
                                  "png_grey16", "png_rgba"])  # fmt: skip
def test_cmyk_and_16_bit_through_every_format(backend: str, case: str) -> None:
    """Every format of a variant shows the same picture as its WebP (only the encoders'
    own losses apart)."""
    out = create_handler(backend, EVERY_FORMAT).derive(imagegen.case(case), EVERY_FORMAT)
    assert len(out) == 8
    for name in ("v", "c"):
        of = {v.format: v for v in out if v.name == name}
        for fmt, v in of.items():
            with Image.open(io.BytesIO(v.data)) as im:
                assert im.format == MAGIC[fmt]
                assert im.mode in ("RGB", "RGBA", "L", "LA", "P")
            # JPEG has no alpha: compare it with the WebP flattened on white.
            reference = of["webp"].data
            if fmt == "jpeg" and case == "png_rgba":
                flat = Image.new("RGBA", (v.width, v.height), (255, 255, 255, 255))
                flat.alpha_composite(Image.open(io.BytesIO(reference)).convert("RGBA"))
                buf = io.BytesIO()
                flat.save(buf, "PNG")
                reference = buf.getvalue()
            assert mad(v.data, reference) <= FORMAT_MAD, (name, fmt)


# --- animation -------------------------------------------------------------------------------

ANIMATED = spec_of(
    VariantSpec("anim", 120, formats=("webp", "avif"), animated=True),
    VariantSpec("still", 120),
    VariantSpec("card", box=(60, 60), fit="cover", gravity="entropy", animated=True),
)


def frames_of(data: bytes) -> list[tuple[int, int]]:
    """(mean red, duration ms) of every frame."""
    with Image.open(io.BytesIO(data)) as im:
        found = []
        for index in range(getattr(im, "n_frames", 1)):
            im.seek(index)
            rgb = im.convert("RGB")
            found.append((round(ImageStat.Stat(rgb).mean[0]), int(im.info.get("duration", 0))))
        return found


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["gif_animated", "webp_animated"])
def test_animation_kept_when_asked(backend: str, case: str) -> None:
    count = {"gif_animated": 5, "webp_animated": 4}[case]
    out = create_handler(backend, ANIMATED).derive(imagegen.case(case), ANIMATED)
    assert [(v.name, v.format, v.width, v.height) for v in out] == [
        ("anim", "webp", 120, 90), ("anim", "avif", 120, 90), ("still", "webp", 120, 90),
        ("card", "webp", 60, 60)]  # fmt: skip
    for v in out:
        frames = frames_of(v.data)
        assert len(frames) == (1 if v.name == "still" else count), (v.name, v.format)
        assert abs(frames[0][0] - imagegen.FIRST_FRAME_RGB[0]) < 12  # frame 0 first
        assert all(red < 40 for red, _ in frames[1:])  # then the blue ones, in order
        if len(frames) > 1:
            assert all(duration == 80 for _, duration in frames), frames


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "make", [imagegen.gif_10000_frames, imagegen.gif_many_frames,
             imagegen.gif_frames_times_pixels, imagegen.gif_bomb],
    ids=["10000_frames", "150_frames", "frames_times_pixels", "one_huge_frame"],
)  # fmt: skip
def test_animated_bombs_stop_at_the_header(backend: str, make: imagegen.Factory) -> None:
    """Few bytes, many or huge frames: refused from the header, animated or not."""
    with pytest.raises(ResourceLimit):
        create_handler(backend, ANIMATED).derive(make(), ANIMATED)


@pytest.mark.parametrize("backend", BACKENDS)
def test_frames_times_pixels_counts_every_frame(backend: str, monkeypatch: pytest.MonkeyPatch
                                                ) -> None:  # fmt: skip
    """5 frames of 240 x 180 = 216 000 px: allowed at exactly that, refused one below."""
    # The Pillow handler sets this process-wide from max_pixels; undo it for later tests.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)
    data = imagegen.gif_animated()
    exact = spec_of(*ANIMATED.variants, max_pixels=5 * 240 * 180)
    assert len(create_handler(backend, exact).derive(data, exact)) == 4
    below = spec_of(*ANIMATED.variants, max_pixels=5 * 240 * 180 - 1)
    with pytest.raises(ResourceLimit):
        create_handler(backend, below).derive(data, below)


# --- one decode for all variants: parity with the per-variant call it replaced ---------------

# CIELAB TIFF never went through a plain thumbnail_buffer (libvips refuses it; the handler
# relabels it), so there is no per-variant call to compare it with.
PER_VARIANT_CASES = [name for name, _, expected in imagegen.CASES if expected == "ready"
                     and "animated" not in name and name != "tiff_cielab"]  # fmt: skip
DEFAULT = DeriveSpec(variants=(VariantSpec("preview", 1600), VariantSpec("thumb", 320)))


def per_variant_vips(original: bytes, width: int, height: int) -> bytes:
    """What the vips handler did before one decode: one thumbnail_buffer per variant."""
    import pyvips

    from derivd.handlers.vips import read_header, sniff_loader

    icc = read_header(original, sniff_loader(original)).needs_icc
    image = pyvips.Image.thumbnail_buffer(
        original, width, height=height, size="force", option_string="fail_on=error",
        **({"output_profile": "srgb", "intent": "relative"} if icc else {}),
    )  # fmt: skip
    data: bytes = image.webpsave_buffer(Q=DEFAULT.quality, effort=DEFAULT.effort, keep="none")
    return data


@pytest.mark.parametrize("case", PER_VARIANT_CASES)
def test_one_decode_matches_the_per_variant_output(case: str) -> None:
    """vips derives the thumb from the decoded preview instead of decoding again; the
    pixels stay within PARITY_MAD of the old per-variant output (Pillow always decoded
    once, and its other tests pin it)."""
    data = imagegen.case(case)
    for v in create_handler("vips", DEFAULT).derive(data, DEFAULT):
        assert mad(v.data, per_variant_vips(data, v.width, v.height)) <= PARITY_MAD, v.name


# --- AVIF at the largest size the config allows ------------------------------------------------

AVIF_PEAK = """
import json, sys
from pathlib import Path
sys.path.insert(0, {support!r})
import imagegen
from derivd.handlers.base import DeriveSpec, VariantSpec
from derivd.handlers.registry import create_handler

def peak_mib():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024

spec = DeriveSpec(variants=(VariantSpec("v", box=(4096, 4096), fit="cover", upscale=True,
                                        formats=("avif",)),))
handler = create_handler({backend!r}, spec)
(out,) = handler.derive(imagegen._save(imagegen.scene(640, 640), "PNG"), spec)
print(json.dumps({{"size": [out.width, out.height], "magic": out.data[4:12].decode(),
                  "peak_mib": peak_mib()}}))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_largest_allowed_avif_fits_the_worker_memory_bound(backend: str) -> None:
    """4096 x 4096 (AVIF_MAX_PIXELS, the most `config check` lets an avif variant ask for)
    encodes in a fresh process whose peak RSS stays under the default recycle bound."""
    assert AVIF_MAX_PIXELS == 4096 * 4096
    script = AVIF_PEAK.format(support=str(SUPPORT), backend=backend)
    run = subprocess.run([sys.executable, "-c", script],
                         capture_output=True, text=True, check=True, timeout=600)  # fmt: skip
    result = json.loads(run.stdout)
    assert result["size"] == [4096, 4096] and result["magic"] == "ftypavif"
    assert result["peak_mib"] < SupervisorSettings().max_worker_rss_mb, result


# --- AVIF quality on WebP's scale ------------------------------------------------------------

CORPUS_PHOTO = CORPUS / "exif-orientation" / "Landscape_0.jpg"


def test_avif_quality_is_mapped_to_webps_fidelity() -> None:
    """The calibrated points (bench/avif.py --calibrate), monotonic, ends kept."""
    assert [avif_quality(q) for q in (1, 50, 60, 70, 80, 90, 100)] == [1, 49, 52, 56, 64, 81, 100]
    mapped = [avif_quality(q) for q in range(1, 101)]
    assert mapped == sorted(mapped) and all(1 <= q <= 100 for q in mapped)


@pytest.mark.parametrize("backend", BACKENDS)
def test_avif_at_the_default_quality_is_no_larger_than_webp_on_a_photo(backend: str) -> None:
    """At WebP's own quality number AVIF came out larger than WebP (1.2x here, 5x on
    grain); mapped, a photograph's AVIF is smaller than its WebP."""
    spec = spec_of(VariantSpec("v", 320, formats=("webp", "avif")))
    webp, avif = create_handler(backend, spec).derive(CORPUS_PHOTO.read_bytes(), spec)
    assert avif.format == "avif"
    assert len(avif.data) < len(webp.data), (len(avif.data), len(webp.data))


# --- the JPEG writer --------------------------------------------------------------------------

JPEG_AND_PNG = spec_of(VariantSpec("v", box=(160, 120), fit="cover", formats=("jpeg", "png")))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["jpeg_baseline", "jpeg_grey", "png_rgb16"])
def test_jpeg_variants_are_libjpeg_turbos_writing_of_the_variants_pixels(backend: str, case: str
                                                                         ) -> None:  # fmt: skip
    """Both backends write JPEG with one writer (`save_jpeg`: Pillow's libjpeg-turbo, 4:2:0,
    optimised Huffman tables): the JPEG variant is byte for byte that writer's output for
    the pixels of the PNG variant beside it (lossless: the same shaped image). libvips'
    own jpegsave (mozjpeg in pyvips-binary) writes other bytes. Grey stays one channel on
    the vips backend."""
    from derivd.handlers.pillow_variants import save_jpeg

    out = create_handler(backend, JPEG_AND_PNG).derive(imagegen.case(case), JPEG_AND_PNG)
    of = {v.format: v.data for v in out}
    with Image.open(io.BytesIO(of["png"])) as shaped:
        expected = save_jpeg(shaped.convert(shaped.mode), 80)
        grey = shaped.mode == "L"
    assert of["jpeg"] == expected
    with Image.open(io.BytesIO(of["jpeg"])) as written:
        assert written.mode == ("L" if grey else "RGB")
        assert grey == (backend == "vips" and case == "jpeg_grey")
