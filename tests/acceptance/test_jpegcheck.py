"""Damaged JPEGs are rejected and unusual valid ones derived, on both backends
(handlers/jpegcheck.py): libjpeg's warnings about the scan data are `corrupt_content` on
the first attempt, whichever decoder runs (the fast one, or the backend's own at
`shrink_on_load = off` and for CMYK); arithmetic-coded, CMYK, arithmetic CMYK,
progressive and restart-marker JPEGs derive, to the same pixels as their plain twin, and
so do odd but whole ones (data after the end marker, fill bytes, an unknown JFIF
revision, which libjpeg warns about). The files are made here: the photo by Pillow, the
codings by libjpeg-turbo's jpegtran (the same coefficients), the damage by flipping bytes
after the SOS marker. Then the whole daemon, `derivd run --burst` on PostgreSQL, on both
backends."""

from __future__ import annotations

import io
import random
import shutil
import subprocess
from functools import cache
from pathlib import Path

import imagegen
import pytest
from fixtures.burst import (
    burst_ends_on_first_attempt,
)
from PIL import Image, ImageChops, ImageStat

from derivd.handlers.base import CorruptContent, DeriveSpec, VariantSpec
from derivd.handlers.jpegcheck import check_jpeg, is_damage
from derivd.handlers.registry import create_handler

BACKENDS = ("vips", "pillow")
MODES = ("fast", "off")  # the fast decoder where it takes the file; each backend's own

# --- the rule -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        "Corrupt JPEG data: 25 extraneous bytes before marker 0xd9",
        "Corrupt JPEG data: premature end of data segment",
        "Corrupt JPEG data: bad Huffman code",
        "Corrupt JPEG data: bad arithmetic code",
        "Corrupt JPEG data: found marker 0xd9 instead of RST3",
        "Premature end of JPEG file",
        "Invalid JPEG file structure: two SOF markers",
        "Unsupported marker type 0x1c",
        "Invalid progressive parameters Ss=1 Se=63 Ah=7 Al=11",
    ],
)
def test_damage(message: str) -> None:
    assert is_damage(message)


@pytest.mark.parametrize(
    "message",
    [
        "Warning: unknown JFIF revision number 3.01",
        "Unknown Adobe color transform code 7",
        "Invalid SOS parameters for sequential JPEG",
        "Inconsistent progression sequence for component 0 coefficient 1",
        "Corrupt JPEG data: bad ICC marker",  # the profile, not the pixels
        "Unsupported JPEG data precision 12",
        "Unsupported JPEG process: SOF type 0xc3",
        "Unsupported color conversion request",
        "Empty JPEG image (DNL not supported)",
    ],
)
def test_not_damage(message: str) -> None:
    assert not is_damage(message)


def test_only_jpegs_are_checked() -> None:
    check_jpeg(imagegen.png_bad_crc())  # nothing: the PNG's own checks judge it
    with pytest.raises(CorruptContent, match="extraneous bytes"):
        check_jpeg(imagegen.scan_flipped(plain()))


# --- the files ------------------------------------------------------------------------------

JPEGTRAN = shutil.which("jpegtran")


@cache
def photo() -> Image.Image:
    """Photo-like (the scene with grain), so the files pass Pillow's 64 KiB reads; the
    grain seeded, so each flip meets the same bits every run."""
    size = (1024, 683)
    grain = Image.frombytes("L", size, random.Random(43).randbytes(size[0] * size[1]))
    return Image.blend(imagegen.scene(*size), grain.convert("RGB"), 0.2)


def _save(im: Image.Image, **params: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=90, **params)
    return buf.getvalue()


@cache
def plain() -> bytes:
    return _save(photo())


@cache
def cmyk() -> bytes:
    return _save(photo().convert("CMYK"))


def jpegtran(data: bytes, *options: str) -> bytes:
    """`data` transcoded by libjpeg-turbo's jpegtran: the same coefficients, coded anew."""
    if JPEGTRAN is None:
        pytest.skip("jpegtran not found (apt-get install libjpeg-turbo-progs)")
    done = subprocess.run([JPEGTRAN, *options], input=data, capture_output=True, check=True)
    return done.stdout


# name -> (the file, the plain twin whose pixels it must derive to)
VALID = {
    "progressive": (lambda: _save(photo(), progressive=True), plain),
    "arithmetic": (lambda: jpegtran(plain(), "-arithmetic"), plain),
    "arithmetic-progressive": (lambda: jpegtran(plain(), "-arithmetic", "-progressive"), plain),
    "restart": (lambda: jpegtran(plain(), "-restart", "1"), plain),
    "restart-arithmetic": (lambda: jpegtran(plain(), "-restart", "1", "-arithmetic"), plain),
    "cmyk": (cmyk, cmyk),
    "cmyk-arithmetic": (lambda: jpegtran(cmyk(), "-arithmetic"), cmyk),
    "cmyk-progressive": (lambda: jpegtran(cmyk(), "-progressive"), cmyk),
    # Odd but whole: what libjpeg skips without a word, or only warns about in the header.
    "data-after-the-end": (lambda: plain() + b"\x00trailer" * 64 + plain(), plain),
    "fill-bytes-before-a-marker": (lambda: _before_sos(plain(), b"\xff" * 7), plain),
    "unknown-jfif-revision": (lambda: _jfif_revision(plain(), 3), plain),
}


def _before_sos(data: bytes, insert: bytes) -> bytes:
    at = data.index(b"\xff\xda")
    return data[:at] + insert + data[at:]


def _jfif_revision(data: bytes, major: int) -> bytes:
    out = bytearray(data)
    out[out.index(b"JFIF\x00") + 5] = major
    return bytes(out)


# 40 bytes flipped mid-scan: what libjpeg says about each (djpeg says the same). A flip
# after which the Huffman decoder happens to fall back in step draws no word from libjpeg
# (djpeg exits 0), and no libjpeg-based decoder can tell: the seeded grain keeps these
# flips the ones it does tell, every run.
DAMAGED = {
    "plain": "extraneous bytes before marker 0xd9",  # the end marker
    "progressive": "bad Huffman code",
    "arithmetic": "extraneous bytes",
    "arithmetic-progressive": "extraneous bytes before marker 0xda",  # the next scan
    "restart": "extraneous bytes before marker 0xd5",  # a restart marker, RST5
    "restart-arithmetic": "extraneous bytes before marker 0xd5",
    "cmyk": "extraneous bytes",
    "cmyk-arithmetic": "extraneous bytes",
    "cmyk-progressive": "bad Huffman code",
}


def _valid(name: str) -> bytes:
    return VALID[name][0]() if name in VALID else plain()


def _handler_spec(mode: str) -> DeriveSpec:
    return DeriveSpec(variants=(VariantSpec("v", 400, formats=("png",)),), concurrency=1,
                      shrink_on_load=mode)  # fmt: skip


def _mad(a: bytes, b: bytes) -> float:
    pair = [Image.open(io.BytesIO(d)).convert("RGB") for d in (a, b)]
    return max(ImageStat.Stat(ImageChops.difference(*pair)).mean)


# --- both backends, both decoders -------------------------------------------------------------


@pytest.mark.parametrize("name", list(VALID))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_valid_unusual_jpegs_derive_as_their_plain_twin(backend: str, mode: str, name: str
                                                        ) -> None:  # fmt: skip
    spec = _handler_spec(mode)
    handler = create_handler(backend, spec)
    make, twin = VALID[name]
    (out,) = handler.derive(make(), spec)
    (reference,) = handler.derive(twin(), spec)
    assert (out.width, out.height) == (400, 267)
    # The same coefficients (jpegtran's, or Pillow's progressive save of the same pixels):
    # the same pixels but for a resampler's rounding.
    assert _mad(bytes(out.data), bytes(reference.data)) < 2.0


@pytest.mark.parametrize("name", list(DAMAGED))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_damaged_scan_data_is_corrupt_content(backend: str, mode: str, name: str) -> None:
    spec = _handler_spec(mode)
    handler = create_handler(backend, spec)
    with pytest.raises(CorruptContent, match=DAMAGED[name]):
        handler.derive(imagegen.scan_flipped(_valid(name)), spec)


@pytest.mark.parametrize("make", [plain, cmyk], ids=["whole-scan", "first-200k-of-cmyk"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_scan_overwritten_is_corrupt_content(backend: str, mode: str, make: object) -> None:
    """A file rewritten after its header, wholly or in its first 200 KB: libvips published
    a grey preview of it, Pillow's decoder failed (the backends disagreed, before)."""
    spec = _handler_spec(mode)
    damaged = imagegen.scan_overwritten(make(), upto=200_000)  # type: ignore[operator]
    with pytest.raises(CorruptContent):
        create_handler(backend, spec).derive(damaged, spec)


# --- the whole daemon -------------------------------------------------------------------------

THROUGH_THE_DAEMON = [
    ("scan-flipped", lambda: imagegen.scan_flipped(plain()), "corrupt_content"),
    ("cmyk-arithmetic-scan-flipped", lambda: imagegen.scan_flipped(_valid("cmyk-arithmetic")),
     "corrupt_content"),
    ("scan-overwritten", lambda: imagegen.scan_overwritten(plain()), "corrupt_content"),
    ("cmyk-arithmetic", lambda: _valid("cmyk-arithmetic"), "ready"),
    ("arithmetic", lambda: _valid("arithmetic"), "ready"),
    ("restart", lambda: _valid("restart"), "ready"),
]  # fmt: skip


@pytest.mark.acceptance
@pytest.mark.parametrize("backend", BACKENDS)
def test_through_the_daemon(backend: str, dsn: str, fs_root: Path, tmp_path: Path) -> None:
    """`derivd run --burst`: each damaged file `rejected corrupt_content` at attempt 1,
    each unusual valid one `ready` at attempt 1."""
    burst_ends_on_first_attempt(
        dsn, fs_root, tmp_path, THROUGH_THE_DAEMON, backend=backend, job_timeout=20,
        max_rss_mb=300, lease=60,
    )  # fmt: skip
