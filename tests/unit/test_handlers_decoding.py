"""What escapes a decoder, codecs a backend lacks, and CIELAB TIFF.

Case tables live in tests/support/imagegen.py (tiff_offsets_*, tiff_jpeg2000, tiff_cielab run on
both backends in test_handlers.py and through `derivd run` in test_hostile.py); this
module holds what differs per backend and the shared guard itself.
"""

from __future__ import annotations

import io
import logging
import struct

import imagegen
import pytest
from fixtures.pixels import MISTAKE_MAD, PARITY_MAD, SPEC, mad, reference
from PIL import Image, ImageChops, ImageStat

from derivd.handlers import pillow as pillow_backend
from derivd.handlers import vips as vips_backend
from derivd.handlers.base import (
    CorruptContent,
    DeriveSpec,
    Handler,
    MissingEncoder,
    Permanent,
    Transient,
    UnsupportedContent,
    VariantSpec,
    decoding,
    target_size,
)
from derivd.handlers.registry import create_handler, missing_encoder

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


# --- decoder faults and encoder faults -----------------------------------


@pytest.mark.parametrize(
    ("backend", "target"),
    [("pillow", "derivd.handlers.pillow_variants.encode"),
     ("vips", "derivd.handlers.vips_variants.encode")],
)  # fmt: skip
def test_an_encoder_fault_is_processing_failed(
    backend: str, target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The original decoded fine; what the encoder raises is not the content's fault
    (it was corrupt_content while `decoding()` wrapped the whole derive)."""
    handler = create_handler(backend, SPEC)

    def broken(*args: object, **kwargs: object) -> bytes:
        raise ValueError("encoder exploded")

    monkeypatch.setattr(target, broken)
    with pytest.raises(Permanent) as caught:
        handler.derive(imagegen.jpeg(), SPEC)
    assert caught.value.code == "processing_failed"


@pytest.mark.parametrize("backend", ["vips", "pillow"])
def test_a_truncated_original_is_still_the_decoders_fault(backend: str) -> None:
    """libvips decodes lazily: the base is rendered before any encoder, so a cut JPEG
    fails in the decode (corrupt_content), not in the saver (processing_failed)."""
    handler = create_handler(backend, DeriveSpec(variants=(VariantSpec("only", 320),)))
    with pytest.raises(Permanent) as caught:
        handler.derive(imagegen.truncated(imagegen.jpeg, 0.5)(), SPEC)
    assert caught.value.code == "corrupt_content"


def _avif_declaring(width: int, height: int) -> bytes:
    data = bytearray(imagegen.avif())
    at = data.index(b"ispe")
    data[at + 8 : at + 16] = struct.pack(">II", width, height)
    return bytes(data)


@pytest.mark.parametrize("backend", ["vips", "pillow"])
def test_a_17000_square_avif_is_a_resource_limit(backend: str) -> None:
    """289 MP declared: libavif refuses it in words Pillow reported as unidentifiable
    (corrupt_content); the declared size is checked first, as libvips' header is."""
    with pytest.raises(Permanent) as caught:
        create_handler(backend, SPEC).derive(_avif_declaring(17000, 17000), SPEC)
    assert caught.value.code == "resource_limit"


AVIF_SPEC = DeriveSpec(variants=(VariantSpec("card", 320, formats=("avif", "webp")),))


def test_pillow_without_an_avif_encoder_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """An old Pillow (wheels before 11.3.0) has no AVIF: the handler is never created, and the
    reason is one line (the worker's boot error stops the supervisor with it)."""
    real = pillow_backend.features.check
    monkeypatch.setattr(
        pillow_backend.features, "check", lambda name: name != "avif" and real(name)
    )
    with pytest.raises(MissingEncoder) as caught:
        create_handler("pillow", AVIF_SPEC)
    assert "avif" in str(caught.value) and "\n" not in str(caught.value)
    create_handler("pillow", SPEC)  # WebP only: fine
    # `derivd config check` says the same before anything starts.
    assert missing_encoder("pillow", AVIF_SPEC) == str(caught.value)
    assert missing_encoder("pillow", SPEC) is None


def test_vips_without_a_saver_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    real = vips_backend.pyvips.type_find

    def no_heifsave(base: str, name: str) -> int:
        return 0 if name == "heifsave_buffer" else int(real(base, name))

    monkeypatch.setattr(vips_backend.pyvips, "type_find", no_heifsave)
    with pytest.raises(MissingEncoder) as caught:
        create_handler("vips", AVIF_SPEC)
    assert "avif" in str(caught.value) and "\n" not in str(caught.value)


def test_a_worker_reports_a_missing_encoder_in_one_line() -> None:
    """The boot error the supervisor stops with is the reason itself, no class name."""
    from derivd.processes.child import _boot_error_text

    reason = "backend pillow: Pillow 10.4.0 cannot write avif"
    assert _boot_error_text(MissingEncoder(reason)) == reason


class _Original(bytearray):
    """Bytes a weak reference can follow (bytes itself takes none)."""


def test_the_original_read_in_place_lives_as_long_as_an_image_that_reads_it() -> None:
    """The vips loaders read the caller's bytes where they are (no copy): every image
    computed from them keeps them alive, whoever else lets go, and lets go in the end."""
    import gc
    import weakref

    from derivd.handlers.vips_variants import read_in_place

    data = imagegen.jpeg()
    expected = read_in_place("jpegload_source", data).thumbnail_image(40, height=30).avg()
    original = _Original(data)
    alive = weakref.ref(original)
    loaded = read_in_place("jpegload_source", original, access="sequential")
    shrunk = loaded.thumbnail_image(40, height=30)  # lazy: nothing decoded yet
    del original, loaded
    gc.collect()
    assert alive() is not None  # only `shrunk` (through its input) holds the bytes now
    assert shrunk.avg() == expected
    del shrunk
    gc.collect()
    assert alive() is None


def test_libvips_info_lines_stay_in_c_and_its_warnings_reach_python(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """libvips' INFO lines (~10 a derive) are left to GLib, which drops them; a warning
    about the user's file still reaches the `pyvips` logger (vips.log_problems_only), also
    after a second handler re-registered it (a worker's handler after a reload)."""
    spec = DeriveSpec(variants=(VariantSpec("only", 320),))
    create_handler("vips", spec)
    handler = create_handler("vips", spec)
    jpeg = imagegen.jpeg(640, 480)
    with caplog.at_level(logging.DEBUG, logger="pyvips"):
        handler.derive(jpeg, spec)
        clean = [r.getMessage() for r in caplog.records if r.getMessage().startswith("VIPS:")]
        caplog.clear()
        # JFIF 3.01: libjpeg warns, and it is no damage (handlers/jpegcheck.py), so the
        # file reaches libvips' own decoder, which passes the warning on.
        unknown_jfif = bytearray(jpeg)
        unknown_jfif[unknown_jfif.index(b"JFIF\x00") + 5] = 3
        handler.derive(bytes(unknown_jfif), spec)
        warned = [r for r in caplog.records if r.getMessage().startswith("VIPS:")]
    assert clean == []
    assert warned and all(r.levelno >= logging.WARNING for r in warned)
    assert any("JFIF revision" in r.getMessage() for r in warned)
