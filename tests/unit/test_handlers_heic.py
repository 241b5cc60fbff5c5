"""HEIC/HEIF on both backends, on the corpus in tests/corpus/heic (README.md there says
where each file comes from), at handler level; test_hostile_heic runs the same files
through `derivd run --burst`.

The corpus is in the repository: these tests never skip, and a missing file fails.
"""

from __future__ import annotations

import base64
import io
import struct

import pi_heif
import pytest
from fixtures.analysis import average_rgb, hamming
from fixtures.corpus import HEIC, READY, REJECTED
from fixtures.pixels import (
    BACKENDS,
    MISTAKE_MAD,
    PARITY_MAD,
    RAISE_IF_DECODED,
    SPEC,
    mad,
    never_decoded,
    riff_chunks,
)
from PIL import Image, ImageCms, ImageStat

from derivd.handlers.base import Analysis, Derivation, Handler, Permanent, target_size
from derivd.handlers.isobmff import declared

pytestmark = pytest.mark.corpus

BOMBS = [name for name in REJECTED if name.startswith("bomb_")]
# Both backends shrink the same decoded pixels with their own resamplers (measured 0.4-1.1).
HEIC_PARITY_MAD = PARITY_MAD


def read(name: str) -> bytes:
    return (HEIC / name).read_bytes()


def derive(handler: Handler, data: bytes) -> tuple[Derivation, Analysis]:
    out = Derivation.of(handler.derive(data, SPEC))
    assert out.original is not None
    return out, out.original


def test_the_corpus_is_complete_and_licensed() -> None:
    files = {p.name for p in HEIC.iterdir() if p.suffix in (".heic", ".heif")}
    assert files == set(READY) | set(REJECTED)
    assert "BSD" in (HEIC / "LICENSE").read_text() or "Redistribution" in (
        HEIC / "LICENSE").read_text()  # fmt: skip
    assert sum((HEIC / f).stat().st_size for f in files) < 4 * 1024 * 1024


@pytest.mark.parametrize("name", sorted(READY))
def test_ready_file(handler: Handler, name: str) -> None:
    width, height, frames, alpha = READY[name]
    out, original = derive(handler, read(name))
    assert [(v.width, v.height) for v in out] == [
        target_size(width, height, v.long_edge) for v in SPEC.variants
    ]
    for variant in out:
        assert variant.format == "webp"
        assert not {b"ICCP", b"EXIF", b"XMP "} & set(riff_chunks(variant.data))
    assert (original.width, original.height, original.frames, original.has_alpha) == (
        width, height, frames, alpha)  # fmt: skip
    assert original.format == "heic"


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_rejected_file(handler: Handler, name: str) -> None:
    with pytest.raises(Permanent) as caught:
        handler.derive(read(name), SPEC)
    assert caught.value.code == REJECTED[name]


@pytest.mark.parametrize("name", BOMBS)
def test_bombs_are_refused_before_any_pixel_is_decoded(
    handler: Handler, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limits come from the boxes and libheif's handles: decoding one pixel fails
    the test (never_decoded makes pi-heif's decode raise)."""
    never_decoded(monkeypatch)
    with pytest.raises(Permanent) as caught:
        handler.derive(read(name), SPEC)
    assert caught.value.code == "resource_limit"
    assert RAISE_IF_DECODED not in str(caught.value)


def _box(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", 8 + len(payload)) + kind + payload


def _with_track(data: bytes, samples: int) -> bytes:
    """The file plus a `moov` whose one track declares `samples` samples (an image
    sequence: libheif lists only items, so the boxes are where the count is)."""
    stsz = _box(b"stsz", bytes(4) + struct.pack(">II", 0, samples))
    track = _box(b"trak", _box(b"mdia", _box(b"minf", _box(b"stbl", stsz))))
    return data + _box(b"moov", track)


def test_a_long_image_sequence_is_refused_from_its_boxes(
    handler: Handler, monkeypatch: pytest.MonkeyPatch
) -> None:
    never_decoded(monkeypatch)
    assert declared(_with_track(read("burst_5.heic"), 1000)).samples == 1000
    with pytest.raises(Permanent) as caught:
        handler.derive(_with_track(read("burst_5.heic"), 1000), SPEC)
    assert caught.value.code == "resource_limit"


def test_the_bombs_are_what_they_say() -> None:
    """Each bomb holds the trap its name says (otherwise the test above proves nothing)."""
    huge = pi_heif.open_heif(read("bomb_200mp.heic"))
    assert huge.size[0] * huge.size[1] == 200_000_000
    assert len(pi_heif.open_heif(read("bomb_1000_frames.heic"))) == 1000
    assert declared(read("bomb_2048_tiles.heic")).tiles == 2048


def test_a_portrait_phone_photo_stays_portrait(both: dict[str, Handler]) -> None:
    """arrow.heic is stored landscape with an irot transform; its EXIF also says
    orientation 6. Applied once (the transform), it is portrait; applied twice, landscape."""
    data = read("arrow.heic")
    exif = Image.Exif()
    exif.load(pi_heif.open_heif(data).info["exif"])
    assert exif.get(0x0112) == 6  # the trap
    assert declared(data).size == (4032, 3024)  # stored landscape
    outs = {b: h.derive(data, SPEC) for b, h in both.items()}
    for out in outs.values():
        assert out[0].width < out[0].height
    assert mad(outs["vips"][1].data, outs["pillow"][1].data) <= HEIC_PARITY_MAD
    turned = Image.open(io.BytesIO(outs["vips"][1].data)).convert("RGBA").rotate(180)
    assert mad(outs["vips"][1].data, turned) > MISTAKE_MAD


def _primary(data: bytes) -> Image.Image:
    """The primary's pixels as pi-heif decodes them (no colour management)."""
    f = pi_heif.open_heif(data)
    im = f[f.primary_index]
    return Image.frombytes(im.mode, im.size, im.data, "raw", im.mode, im.stride)


def test_the_display_p3_profile_is_converted(both: dict[str, Handler]) -> None:
    """pug.heic's profile is Display P3. Each backend's output is near the pixels sent
    through that profile to sRGB with LittleCMS directly, and clearly nearer to them than
    to the P3 values shown as sRGB (what ignoring the profile gives)."""
    data = read("pug.heic")
    p3 = ImageCms.ImageCmsProfile(io.BytesIO(pi_heif.open_heif(data).info["icc_profile"]))
    assert ImageCms.getProfileDescription(p3).strip() == "Display P3"
    outs = {b: h.derive(data, SPEC)[1] for b, h in both.items()}
    assert mad(outs["vips"].data, outs["pillow"].data) <= HEIC_PARITY_MAD
    size = (outs["vips"].width, outs["vips"].height)
    raw = _primary(data).resize(size, Image.Resampling.LANCZOS)
    srgb = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB"))
    managed = ImageCms.profileToProfile(
        raw, p3, srgb, ImageCms.Intent.RELATIVE_COLORIMETRIC, outputMode="RGB"
    )
    assert managed is not None
    # The photo is not very saturated and WebP noise is ~2 levels per pixel, so compare
    # means, where the noise cancels: P3 -> sRGB moves the mean red by ~0.9 level.
    want, naive = ImageStat.Stat(managed).mean, ImageStat.Stat(raw).mean
    for out in outs.values():
        got = ImageStat.Stat(Image.open(io.BytesIO(out.data)).convert("RGB")).mean
        right = sum(abs(g - w) for g, w in zip(got, want, strict=True))
        wrong = sum(abs(g - n) for g, n in zip(got, naive, strict=True))
        assert right < wrong / 2, (right, wrong)


@pytest.mark.parametrize("name", ["RGB_12__29x100.heif", "RGBA_10__29x100.heif",
                                  "L_10__29x100.heif"])  # fmt: skip
def test_deep_files_are_scaled_to_eight_bits(both: dict[str, Handler], name: str) -> None:
    """The files are full-range ramps: scaled right they span 0-255 in 8 bits; clipped
    they would be white, shifted wrong nearly black."""
    outs = [h.derive(read(name), SPEC)[0] for h in both.values()]
    assert mad(outs[0].data, outs[1].data) <= HEIC_PARITY_MAD
    for out in outs:
        low, high = Image.open(io.BytesIO(out.data)).convert("L").getextrema()
        assert low < 40 and high > 215, (low, high)


def test_alpha_is_kept(handler: Handler) -> None:
    out = handler.derive(read("RGBA_10__29x100.heif"), SPEC)[0]
    alpha = Image.open(io.BytesIO(out.data)).convert("RGBA").getchannel("A")
    low, high = alpha.getextrema()
    assert low < 128 and high > 200


@pytest.mark.parametrize("name", ["zPug_3.heic", "burst_5.heic"])
def test_the_primary_image_is_derived(handler: Handler, name: str) -> None:
    """zPug_3's primary is its second image; a burst's is the first."""
    data = read(name)
    f = pi_heif.open_heif(data)
    assert f.primary_index == (1 if name == "zPug_3.heic" else 0)
    out = handler.derive(data, SPEC)[0]
    for index in range(len(f)):
        im = f[index]
        pixels = Image.frombytes(im.mode, im.size, im.data, "raw", im.mode, im.stride)
        expected = pixels.resize((out.width, out.height)).convert("RGBA")
        close = mad(out.data, expected) <= HEIC_PARITY_MAD * 2
        assert close == (index == f.primary_index), index


def test_no_gps_exif_xmp_or_camera_in_a_derivative(handler: Handler) -> None:
    """pug.heic carries GPS, the camera (Apple iPhone) and XMP; no derivative keeps any."""
    data = read("pug.heic")
    exif = Image.Exif()
    exif.load(pi_heif.open_heif(data).info["exif"])
    assert exif.get_ifd(0x8825), "the corpus file must have GPS"
    assert b"iPhone" in data and b"<x:xmpmeta" in data
    out, original = derive(handler, data)
    for variant in out:
        for marker in (b"Exif", b"GPS", b"iPhone", b"Apple", b"xmpmeta", b"ICC_PROFILE"):
            assert marker not in variant.data, marker
    assert "iPhone" not in repr(original) and "Apple" not in repr(original)


def test_backends_agree_on_the_analysis(both: dict[str, Handler]) -> None:
    """All fields but placeholder and dhash equal, colour within 2 levels (test_analysis
    documents the tolerance); dhash within a few bits; placeholder means alike."""
    for name in READY:
        vips, pillow = (derive(both[b], read(name))[1] for b in BACKENDS)
        fields = ("width", "height", "format", "frames", "has_alpha")
        assert [getattr(vips, f) for f in fields] == [getattr(pillow, f) for f in fields]
        for i in (1, 3, 5):
            assert abs(int(vips.colour[i : i + 2], 16) - int(pillow.colour[i : i + 2], 16)) <= 2
        assert hamming(vips.dhash, pillow.dhash) <= 4, name


def test_placeholder_mean_is_the_image_mean(handler: Handler) -> None:
    for name in ("pug.heic", "arrow.heic", "burst_5.heic"):
        out, original = derive(handler, read(name))
        mean = ImageStat.Stat(Image.open(io.BytesIO(out[0].data)).convert("RGB")).mean
        dc = average_rgb(base64.b64decode(original.placeholder))
        for got, want in zip(dc, mean, strict=True):
            assert abs(got * 255 - want) <= 0.10 * 255


def test_dhash_finds_a_re_upload_and_tells_photos_apart(handler: Handler) -> None:
    """pug.heic and its half-size JPEG re-encode within 6 bits; unrelated photos >= 16."""
    pug_out, pug = derive(handler, read("pug.heic"))
    half = Image.open(io.BytesIO(pug_out[0].data)).convert("RGB")
    half = half.resize((half.width // 2, half.height // 2), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    half.save(buf, "JPEG", quality=80)
    again = derive(handler, buf.getvalue())[1]
    assert hamming(pug.dhash, again.dhash) <= 6
    arrow = derive(handler, read("arrow.heic"))[1]
    burst = derive(handler, read("burst_5.heic"))[1]
    for a, b in ((pug, arrow), (pug, burst), (arrow, burst)):
        assert hamming(a.dhash, b.dhash) >= 16


def _full_box(kind: bytes, payload: bytes) -> bytes:
    return _box(kind, bytes(4) + payload)  # version 0, no flags


def _avif_grid(tiles: int) -> bytes:
    """An AVIF whose primary item is a grid of `tiles` AV1 tiles, as its boxes say."""
    ftyp = _box(b"ftyp", b"avif" + bytes(4) + b"avifmif1miaf")
    infe = [
        _box(b"infe", b"\x02\x00\x00\x00" + struct.pack(">HH", item, 0) + kind + b"\x00")
        for item, kind in [(1, b"grid"), *((2 + n, b"av01") for n in range(tiles))]
    ]
    iinf = _full_box(b"iinf", struct.pack(">H", len(infe)) + b"".join(infe))
    dimg = _box(b"dimg", struct.pack(">HH", 1, tiles) + b"".join(
        struct.pack(">H", 2 + n) for n in range(tiles)))  # fmt: skip
    meta = _full_box(b"meta", _full_box(b"pitm", struct.pack(">H", 1)) + iinf
                     + _full_box(b"iref", dimg))  # fmt: skip
    return ftyp + meta


def _small_avif() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 90)).save(buffer, "AVIF")
    return buffer.getvalue()


def test_avif_gets_the_box_level_limits_heic_gets(handler: Handler) -> None:
    """A tile grid or an image sequence declared in an AVIF's boxes went straight to the
    decoder: only HEIC had them counted first (handlers/heif.py, check_boxes)."""
    grid = _avif_grid(2048)
    assert declared(grid).tiles == 2048
    long_sequence = _with_track(_small_avif(), 1000)
    assert declared(long_sequence).samples == 1000
    for data, words in ((grid, "2048 tiles > HEIF_MAX_TILES"), (long_sequence, "1000 frames")):
        with pytest.raises(Permanent) as caught:
            handler.derive(data, SPEC)
        assert caught.value.code == "resource_limit", caught.value
        assert words in str(caught.value)
    out = Derivation.of(handler.derive(_small_avif(), SPEC))  # a plain one still derives
    assert out.original is not None and out.original.format == "avif"
