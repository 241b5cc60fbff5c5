"""The scaled JPEG decode (handlers/jpegscale.py): libjpeg-turbo at the M/8 scale that
`geometry.jpeg_eighths` picks, in both backends. The rule, that the fast decoder really
runs at that scale (and declines what it must), and that what it saves is not visible:
every variant within SSIM 0.98 of the same backend's full decode through its own decoder
(`shrink_on_load = off`), on the corpora and on generated JPEGs of every kind the handlers
take (orientations, ICC, grey, CMYK, progressive, arithmetic-coded), at every scale."""

from __future__ import annotations

import hashlib
import io
import shutil
import subprocess
import tempfile
from dataclasses import replace
from fractions import Fraction
from functools import cache, partial
from pathlib import Path

import imagegen
import pytest
from fidelity import ssim
from fixtures.corpus import CORPUS
from PIL import Image, ImageChops, ImageStat

from derivd.handlers.base import CorruptContent, DeriveSpec, VariantSpec
from derivd.handlers.geometry import (
    SHRINK_EIGHTHS,
    base_size,
    jpeg_eighths,
    jpeg_shrink,
)
from derivd.handlers.jpegscale import decode_scaled, scaled_size
from derivd.handlers.registry import create_handler

BACKENDS = ("vips", "pillow")
SHARED_CORPUS = CORPUS.parents[2] / "shared" / "corpus"  # beside the clone, when there


# --- the rule -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("original", "base", "fast", "safe"),
    [
        ((2725, 2225), (720, 588), 3, 8),  # sharp's fixture, shrink 3.78: 3/8, 1022 x 835
        ((4032, 3024), (784, 588), 2, 4),  # a phone photo to a 720x588 cover: 5.14
        ((3024, 4032), (720, 960), 3, 4),  # 4.2: 1/4 leaves too little; 3/8 where sharp 1/2
        ((6000, 4000), (666, 444), 1, 2),  # 9.0
        ((4000, 4000), (500, 500), 2, 2),  # exactly 8
        ((4032, 3024), (1600, 1200), 8, 8),  # a 1600 px preview of a phone photo: 2.52
        ((800, 600), (784, 588), 8, 8),  # barely any shrink
    ],
)
def test_jpeg_eighths(original: tuple[int, int], base: tuple[int, int], fast: int, safe: int
                      ) -> None:  # fmt: skip
    assert jpeg_eighths(original, base, "fast") == fast
    assert jpeg_eighths(original, base, "safe") == safe
    assert jpeg_eighths(original, base, "off") == 8


def _sharps_rule(shrink: Fraction, mode: str) -> int:
    """sharp's src/pipeline.cc as written there (fastShrinkOnLoad true for `fast`)."""
    factor = 1 if mode == "fast" else 2
    load = next((f for f in (8, 4, 2) if shrink >= f * factor), 1)
    if load > 1 and int(shrink) == load:
        load //= 2
    return load


def test_the_rule_is_sharps_for_shrinks_and_always_leaves_the_headroom() -> None:
    """Over every base of a 4032 x 3024 original: with 1/2, 1/4, 1/8 offered the rule is
    sharp's, to the letter; with 3/8 too, the decode still covers the base with room for
    the resize (its own reduction at most the shrink minus one, half of it when `safe`)."""
    original = (4032, 3024)
    for width in range(40, 4033, 7):
        base = base_size(*original, (VariantSpec("v", width),))
        shrink = min(Fraction(original[0], base[0]), Fraction(original[1], base[1]))
        for mode in ("fast", "safe"):
            assert jpeg_shrink(original, base, mode) == _sharps_rule(shrink, mode)
            assert 8 // jpeg_eighths(original, base, mode, SHRINK_EIGHTHS) == _sharps_rule(
                shrink, mode
            )
            eighths = jpeg_eighths(original, base, mode)
            assert eighths in (1, 2, 3, 4, 8)
            decoded = scaled_size(original, eighths)
            assert decoded[0] >= base[0] and decoded[1] >= base[1]
            if eighths < 8:
                reach = shrink / 2 if mode == "safe" else shrink - 1
                assert Fraction(8, eighths) <= reach


# --- inputs ---------------------------------------------------------------------------------


def _save(im: Image.Image, **params: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "JPEG", **params)
    return buf.getvalue()


@cache
def photo(width: int = 1511, height: int = 1007) -> Image.Image:
    """Photo-like: the generated scene with grain (fine detail shows a scale first); odd
    sides, so the scaled decode ends in a part of a pixel."""
    grain = Image.effect_noise((width, height), 24).convert("RGB")
    return Image.blend(imagegen.scene(width, height), grain, 0.2)


def photo_jpeg() -> bytes:
    return _save(photo(), quality=90)


def photo_progressive() -> bytes:
    return _save(photo(), quality=90, progressive=True)


def photo_grey() -> bytes:
    return _save(photo().convert("L"), quality=90)


def photo_cmyk() -> bytes:
    return _save(photo().convert("CMYK"), quality=90)


def photo_p3() -> bytes:
    """The pixels tagged Display P3: the right output is not the same values."""
    return _save(photo(), quality=90, icc_profile=imagegen.p3_profile())


def photo_444() -> bytes:
    return _save(photo(), quality=90, subsampling=0)


def photo_sideways() -> bytes:
    """Stored landscape, EXIF orientation 6: upright it is a portrait."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return _save(photo().transpose(Image.Transpose.ROTATE_90), quality=90, exif=exif.tobytes())


JPEGTRAN = shutil.which("jpegtran")


@cache
def photo_arithmetic() -> bytes:
    """The photo's JPEG, arithmetic-coded: jpegtran transcodes the same DCT coefficients
    (no encoder derivd has writes arithmetic coding)."""
    if JPEGTRAN is None:
        pytest.skip("jpegtran not found (apt-get install libjpeg-turbo-progs)")
    with tempfile.TemporaryDirectory() as tmp:
        source, coded = Path(tmp) / "in.jpg", Path(tmp) / "out.jpg"
        source.write_bytes(photo_jpeg())
        subprocess.run([JPEGTRAN, "-arithmetic", "-outfile", str(coded), str(source)],
                       check=True)  # fmt: skip
        data = coded.read_bytes()
    assert data.find(b"\xff\xc9") > 0  # SOF9: sequential, arithmetic-coded
    return data


GENERATED = {
    "photo": photo_jpeg,
    "progressive": photo_progressive,
    "grey": photo_grey,
    "cmyk": photo_cmyk,
    "display-p3": photo_p3,
    "subsampling-444": photo_444,
    "sideways": photo_sideways,
    "arithmetic": photo_arithmetic,
    # imagegen's own JPEGs (637 x 401, smooth): every orientation, CMYK with a profile...
    **{f"imagegen-orientation-{n}": partial(imagegen.jpeg_orientation, n) for n in range(1, 9)},
    "imagegen-grey": imagegen.jpeg_grey,
    "imagegen-progressive": imagegen.jpeg_progressive,
    "imagegen-cmyk": imagegen.jpeg_cmyk,
    "imagegen-cmyk-icc": imagegen.jpeg_cmyk_icc,
    "imagegen-bad-exif": imagegen.jpeg_bad_exif,
}


def _corpus_files() -> dict[str, Path]:
    """The JPEGs of tests/corpus and of ../shared/corpus (when it is there), each distinct
    file once."""
    found: dict[str, Path] = {}
    seen: set[str] = set()
    folders = [CORPUS, *([SHARED_CORPUS] if SHARED_CORPUS.is_dir() else [])]
    for folder in folders:
        for path in sorted(folder.rglob("*.jp*g")):
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            if digest not in seen:
                seen.add(digest)
                found[f"{folder.parent.name}/{path.relative_to(folder)}"] = path
    return found


CORPUS = _corpus_files()


def test_the_corpus_has_jpegs() -> None:
    """The parametrised test below would pass on an empty corpus by running nothing."""
    assert len([name for name in CORPUS if name.startswith("tests/")]) >= 18


def _original(name: str) -> bytes:
    return CORPUS[name].read_bytes() if name in CORPUS else GENERATED[name]()


# --- the scale really used ------------------------------------------------------------------


def test_sharps_fixture_size_decodes_at_three_eighths() -> None:
    """2725 x 2225 to a 720 x 588 cover: 3/8, 1022 x 835, where sharp (and libvips' own
    loader) decode 1363 x 1113; the stored image spans 1021.875 x 834.375 of it."""
    original = _save(photo(2725, 2225), quality=90)
    base = base_size(2725, 2225, (VariantSpec("c", box=(720, 588), fit="cover"),))
    assert jpeg_eighths((2725, 2225), base, "fast") == 3
    scaled = decode_scaled(original, (2725, 2225), 3)
    assert scaled is not None
    assert (scaled.width, scaled.height, scaled.mode) == (1022, 835, "RGB")
    assert scaled.pixels.shape == (835, 1022, 3)
    assert scaled.extent == (1021.875, 834.375)


@pytest.mark.parametrize("eighths", [1, 2, 3, 4, 8])
def test_every_kind_it_takes_decodes_at_the_scale_asked(eighths: int) -> None:
    want = scaled_size((1511, 1007), eighths)
    for make, mode in ((photo_jpeg, "RGB"), (photo_progressive, "RGB"), (photo_grey, "L"),
                       (photo_p3, "RGB"), (photo_444, "RGB")):  # fmt: skip
        scaled = decode_scaled(make(), (1511, 1007), eighths)
        assert scaled is not None, make.__name__
        assert (scaled.width, scaled.height, scaled.mode) == (*want, mode)
    padded = decode_scaled(photo_jpeg(), (1511, 1007), eighths, "RGBX")
    assert padded is not None and padded.pixels.shape == (want[1], want[0], 4)
    # CMYK for a caller that asks (Pillow), as the file stores it: Pillow's own decoder
    # reads the same values, inverted (Adobe's convention).
    cmyk = decode_scaled(photo_cmyk(), (1511, 1007), eighths, cmyk=True)
    assert cmyk is not None and cmyk.mode == "CMYK" and cmyk.pixels.shape == (want[1], want[0], 4)
    if eighths == 8:
        ours = Image.frombytes("CMYK", want, cmyk.pixels.tobytes())
        own = ImageChops.invert(Image.open(io.BytesIO(photo_cmyk())))  # back to as stored
        assert max(ImageStat.Stat(ImageChops.difference(ours, own)).mean) < 0.5


def test_arithmetic_coding_decodes_to_the_same_pixels() -> None:
    """jpegtran kept the coefficients: the same pixels at every scale."""
    for eighths in (3, 8):
        coded = decode_scaled(photo_arithmetic(), (1511, 1007), eighths)
        plain = decode_scaled(photo_jpeg(), (1511, 1007), eighths)
        assert coded is not None and plain is not None
        assert (coded.pixels == plain.pixels).all()


def _extraneous_bytes() -> bytes:
    """Junk before the end-of-image marker: libjpeg-turbo warns ("extraneous bytes before
    marker"), the very warning a desynchronised scan gives (`jpegcheck`)."""
    data = photo_jpeg()
    return data[:-2] + b"\x00" * 16 + data[-2:]


def _unknown_jfif() -> bytes:
    """JFIF 3.01: libjpeg-turbo warns about the revision; nothing is wrong with the data."""
    data = bytearray(photo_jpeg())
    data[data.index(b"JFIF\x00") + 5] = 3
    return bytes(data)


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (photo_cmyk, "CMYK: the backends colour-manage it"),
        (imagegen.jpeg_cmyk_icc, "CMYK with a profile"),
        (_unknown_jfif, "a warning that is not damage"),
        (lambda: b"\xff\xd8\xff" + bytes(200), "not a JPEG after its magic"),
    ],
)
def test_what_the_fast_decoder_leaves_to_the_backend(make: object, why: str) -> None:
    data = make()  # type: ignore[operator]
    size = Image.open(io.BytesIO(data)).size if why != "not a JPEG after its magic" else (1, 1)
    assert decode_scaled(data, size, 3) is None, why


@pytest.mark.parametrize(
    "make",
    [lambda: photo_jpeg()[: len(photo_jpeg()) * 2 // 3], _extraneous_bytes,
     lambda: imagegen.scan_flipped(photo_jpeg())],
    ids=["truncated", "extraneous-bytes", "scan-flipped"],
)  # fmt: skip
def test_damage_is_corrupt_content_in_the_fast_decoder(make: object) -> None:
    with pytest.raises(CorruptContent):
        decode_scaled(make(), (1511, 1007), 3)  # type: ignore[operator]


def test_a_header_that_disagrees_or_a_decode_over_the_bound_is_left_too() -> None:
    data = photo_jpeg()
    assert decode_scaled(data, (1510, 1007), 3) is None  # another size than the header's
    want = scaled_size((1511, 1007), 3)
    assert decode_scaled(data, (1511, 1007), 3, max_bytes=want[0] * want[1] * 3) is not None
    assert decode_scaled(data, (1511, 1007), 3, max_bytes=want[0] * want[1] * 3 - 1) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_what_it_leaves_derives_as_before(backend: str) -> None:
    """A warning that is not damage is no error on the backends' own decoders: the file
    still derives; a truncated JPEG is still corrupt_content (final: the first attempt)."""
    spec = DeriveSpec(variants=(VariantSpec("v", 400, formats=("png",)),), concurrency=1)
    handler = create_handler(backend, spec)
    (out,) = handler.derive(_unknown_jfif(), spec)
    assert (out.width, out.height) == (400, 267)
    for keep in (0.3, 0.7, 0.95):
        data = photo_jpeg()
        with pytest.raises(CorruptContent):
            handler.derive(data[: int(len(data) * keep)], spec)


# --- not visible ------------------------------------------------------------------------------

# A long edge for each scale (shrink 10, 5.5, 3.8, 3.2, 2.8 of the original's long edge),
# with a cover of the same scale beside it.
SHRINKS = {1: 10.0, 2: 5.5, 3: 3.8, 4: 3.2, 8: 2.8}


def _variants(upright: tuple[int, int], eighths: int) -> tuple[VariantSpec, ...]:
    edge = round(max(upright) / SHRINKS[eighths])
    box = (round(upright[0] / SHRINKS[eighths]), round(upright[1] / SHRINKS[eighths] * 0.8))
    variants = (VariantSpec("inside", edge, formats=("png",)),
                VariantSpec("cover", box=box, fit="cover", formats=("png",)))  # fmt: skip
    assert jpeg_eighths(upright, base_size(*upright, variants), "fast") == eighths
    return variants


def _derive(backend: str, original: bytes, variants: tuple[VariantSpec, ...], mode: str
            ) -> list[bytes]:  # fmt: skip
    spec = replace(DeriveSpec(variants=variants, concurrency=1), shrink_on_load=mode)
    return [bytes(v.data) for v in create_handler(backend, spec).derive(original, spec)]


def _upright(original: bytes) -> tuple[int, int]:
    im = Image.open(io.BytesIO(original))
    turn = im.getexif().get(0x0112, 1) if im.getexif() else 1
    return (im.size[1], im.size[0]) if turn in (5, 6, 7, 8) else im.size


# Every scale for the generated photo in each of its kinds; 3/8 (the scale libvips cannot
# decode at) for every file of the corpora and imagegen's JPEGs.
CASES = [
    *((name, eighths) for name in GENERATED if not name.startswith("imagegen-")
      for eighths in SHRINKS),
    *((name, 3) for name in [*CORPUS, *GENERATED] if name.startswith(("tests/", "shared/",
                                                                       "imagegen-"))),
]  # fmt: skip


@pytest.mark.parametrize(("name", "eighths"), CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_scaled_decode_is_not_visible(backend: str, name: str, eighths: int) -> None:
    """Per file and scale: every variant the size of the full decode's, SSIM >= 0.98."""
    original = _original(name)
    variants = _variants(_upright(original), eighths)
    fast = _derive(backend, original, variants, "fast")
    full = _derive(backend, _original(name), variants, "off")
    for made, reference in zip(fast, full, strict=True):
        assert Image.open(io.BytesIO(made)).size == Image.open(io.BytesIO(reference)).size
        assert ssim(reference, made) >= 0.98


def _colour_mad(a: bytes, b: bytes) -> float:
    """Worst channel's mean absolute difference of 8 x 8 block means, on 0-255."""
    small = [Image.open(io.BytesIO(d)).convert("RGB").reduce(8) for d in (a, b)]
    return max(ImageStat.Stat(ImageChops.difference(*small)).mean)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_profile_is_applied_to_the_fast_decode(backend: str) -> None:
    """SSIM is luma only: the colour, too, is the full decode's (Display P3 converted to
    sRGB), and not that of the same pixels untagged."""
    variants = _variants((1511, 1007), 3)
    fast, full = (_derive(backend, photo_p3(), variants, mode)[0] for mode in ("fast", "off"))
    untagged = _derive(backend, photo_jpeg(), variants, "fast")[0]
    assert _colour_mad(full, fast) < 1.0
    assert _colour_mad(untagged, fast) > 3.0


@pytest.mark.parametrize("n", range(2, 9))
@pytest.mark.parametrize("backend", BACKENDS)
def test_orientation_pairs_at_three_eighths(backend: str, n: int) -> None:
    """imagegen's orientation n renders upright as orientation 1 does: the same variants
    (SSIM 0.98) through the scaled decode, turned after the resize."""
    upright = _derive(backend, imagegen.jpeg_orientation(1), _variants((637, 401), 3), "fast")
    turned = _derive(backend, imagegen.jpeg_orientation(n), _variants((637, 401), 3), "fast")
    for a, b in zip(upright, turned, strict=True):
        assert Image.open(io.BytesIO(a)).size == Image.open(io.BytesIO(b)).size
        assert ssim(a, b) >= 0.98


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_fast_decode_is_the_one_that_ran(backend: str) -> None:
    """The SSIM checks above would pass trivially if `fast` went through the backend's
    own decoder too: at 3/8 its pixels are not those of jpegload's 1/2 or Pillow's draft.
    And both backends shape the same decoded pixels alike (SSIM 0.98 to each other)."""
    original = photo_jpeg()
    variants = _variants((1511, 1007), 3)
    fast = _derive(backend, original, variants, "fast")
    other = _derive("pillow" if backend == "vips" else "vips", original, variants, "fast")
    safe = _derive(backend, original, variants, "safe")  # 8/8: the headroom of 2
    for made, theirs, half in zip(fast, other, safe, strict=True):
        assert made != half
        assert ssim(theirs, made) >= 0.98


def _sideways_p3() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6
    return _save(photo().transpose(Image.Transpose.ROTATE_90), quality=90,
                 exif=exif.tobytes(), icc_profile=imagegen.p3_profile())  # fmt: skip


@pytest.mark.parametrize("profiled", [False, True])
def test_vips_takes_an_unprofiled_fast_decode_as_the_base(profiled: bool) -> None:
    """libjpeg-turbo's pixels of a sideways photo without a profile come out resized and
    upright (rendered once, no thumbnail_image after them); with a profile they still
    carry it and the orientation for thumbnail_image to apply. Either way the variants
    match the full decode's (the SSIM and orientation tests above)."""
    from derivd.handlers import vips

    original = _sideways_p3() if profiled else photo_sideways()
    spec = DeriveSpec(variants=_variants(_upright(original), 3), concurrency=1)
    create_handler("vips", spec)  # configure libvips as a worker does
    header = vips.read_header(original, vips.sniff_loader(original))
    size = base_size(*header.upright, spec.variants)
    image = vips.turbo_scaled(original, header, size, "fast")
    assert image is not None
    if profiled:
        assert (image.height, image.width) == size  # as stored
        assert image.get("orientation") == 6 and image.get_typeof("icc-profile-data")
    else:
        assert (image.width, image.height) == size
        assert not image.get_typeof("orientation")
