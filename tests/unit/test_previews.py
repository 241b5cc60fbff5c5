"""Previews of PDFs and videos on both backends, at handler level, on files made here
(tests/support/pdfgen.py, tests/support/videogen.py); test_hostile_previews runs the hostile ones
through `derivd run --burst`.

Pictures are checked where a mistake would show: the red block drawn in a known corner
(a wrong rotation or mirror moves it), the colour of the whole (a black first frame, a
washed-out HDR frame) and the two backends against each other (`mad`).
"""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import av
import imagegen
import pdfgen
import pytest
import videogen
from fixtures.pixels import BACKENDS, PARITY_MAD, SPEC, mad
from pdfgen import HOSTILE_PDFS
from PIL import Image
from videogen import HOSTILE_VIDEOS

from derivd.config_checks import ConfigError
from derivd.config_load import load_config
from derivd.handlers import pdf, tonemap, video
from derivd.handlers.base import Derivation, DeriveSpec, Handler, Permanent, PreviewSpec
from derivd.handlers.lazy_numpy import numpy
from derivd.handlers.previews import kind_of
from derivd.handlers.registry import create_handler

RED = (255, 0, 0)


def derive(handler: Handler, data: bytes, spec: DeriveSpec = SPEC) -> Derivation:
    out = Derivation.of(handler.derive(data, spec))
    assert out.original is not None
    return out


def code_of(handler: Handler, data: bytes, spec: DeriveSpec = SPEC) -> str:
    with pytest.raises(Permanent) as caught:
        handler.derive(data, spec)
    return caught.value.code


def picture(out: Derivation, index: int = 0) -> Image.Image:
    return Image.open(io.BytesIO(out[index].data)).convert("RGB")


def is_red(pixel: tuple[int, ...]) -> bool:
    return pixel[0] > 200 and pixel[1] < 60 and pixel[2] < 60


def corner_pixels(image: Image.Image) -> dict[str, tuple[int, ...]]:
    """The colour near each corner (an eighth of the way in)."""
    w, h = image.size
    at = {"top_left": (w // 8, h // 8), "top_right": (w - 1 - w // 8, h // 8),
          "bottom_left": (w // 8, h - 1 - h // 8),
          "bottom_right": (w - 1 - w // 8, h - 1 - h // 8)}  # fmt: skip
    return {name: tuple(image.getpixel(xy)) for name, xy in at.items()}  # type: ignore[arg-type]


# -- kinds ------------------------------------------------------------------------------------


def test_kinds_come_from_the_first_bytes() -> None:
    assert kind_of(pdfgen.pages()) == "pdf"
    assert kind_of(videogen.clip()) == "video"
    assert kind_of(videogen.clip("vp9")) == "video"
    assert kind_of(imagegen.case("avif")) == "image"  # a HEIF brand is an image's
    assert kind_of(pdfgen.behind_jpeg(imagegen.case("jpeg_baseline"))) == "image"
    assert kind_of(b"") == "image"


@pytest.mark.parametrize("kind", ["image", "pdf", "video"])
def test_a_kind_left_out_is_unsupported(handler: Handler, kind: str) -> None:
    originals = {"image": imagegen.case("jpeg_baseline"), "pdf": pdfgen.pages(),
                 "video": videogen.clip()}  # fmt: skip
    spec = replace(SPEC, previews=PreviewSpec(accept=frozenset({"image", "pdf", "video"} - {kind})))
    assert code_of(handler, originals[kind], spec) == "unsupported_content"
    assert derive(handler, originals[kind]).original is not None  # accepted by default


# -- PDF --------------------------------------------------------------------------------------


def test_pdf_page_is_rendered_at_the_largest_variants_size(handler: Handler) -> None:
    out = derive(handler, pdfgen.pages(3))
    # 612 x 792 pt drawn to the 1600 px the preview needs (up from 1 px a point).
    assert [(v.width, v.height) for v in out] == [(1236, 1600), (247, 320)]
    a = out.original
    assert a is not None
    assert (a.width, a.height, a.format, a.frames, a.has_alpha) == (612, 792, "pdf", 3, False)
    assert a.media == {"pages": 3, "page": 1, "page_size": [612.0, 792.0]}
    corners = corner_pixels(picture(out))
    assert is_red(corners["top_left"]) and is_red(corners["top_right"])  # the bar on top
    assert corners["bottom_right"][2] > 200 and corners["bottom_right"][0] < 60  # blue
    assert min(corners["bottom_left"]) > 240  # white, where nothing is painted


def test_rotated_page_is_shown_turned(handler: Handler) -> None:
    out = derive(handler, pdfgen.pages(rotate=90))
    assert (out[0].width, out[0].height) == (1600, 1236)
    assert out.original is not None and out.original.media is not None
    assert out.original.media["page_size"] == [792.0, 612.0]
    corners = corner_pixels(picture(out))
    # /Rotate 90 turns the page clockwise: the red bar along the top is on the right.
    assert is_red(corners["top_right"]) and is_red(corners["bottom_right"])
    assert not is_red(corners["top_left"])


def test_transparent_page_is_on_white(handler: Handler) -> None:
    out = derive(handler, pdfgen.pages(content=b""))
    assert out.original is not None
    assert (out.original.colour, out.original.has_alpha) == ("#ffffff", False)


def test_configured_page_past_the_end_previews_the_last(handler: Handler) -> None:
    spec = replace(SPEC, previews=PreviewSpec(pdf_page=9))
    out = derive(handler, pdfgen.pages(2), spec)
    assert out.original is not None and out.original.media is not None
    assert out.original.media["page"] == 2


def test_empty_user_password_opens_and_another_is_unsupported(handler: Handler) -> None:
    opened = derive(handler, pdfgen.encrypted(b""))
    plain = derive(handler, pdfgen.pages())
    assert mad(opened[1].data, plain[1].data) < PARITY_MAD  # decrypted, not garbage
    assert code_of(handler, pdfgen.encrypted(b"secret")) == "unsupported_content"


# name -> (the file, the code it ends in); test_hostile_previews runs them in the daemon.


@pytest.mark.parametrize("name", HOSTILE_PDFS)
def test_hostile_pdf_ends_in_its_code(handler: Handler, name: str) -> None:
    make, code = HOSTILE_PDFS[name]
    assert code_of(handler, make()) == code


def test_a_render_past_the_memory_budget_is_refused_before_it(handler: Handler) -> None:
    # A cover variant of a page 1 pt wide and 10 000 pt tall: 320 x 3.2 M px.
    spec = replace(SPEC, variants=(replace(SPEC.variants[1], box=(320, 320), fit="cover"),),
                   previews=PreviewSpec(memory_bytes=1024 * 1024 * 1024))  # fmt: skip
    strip = pdfgen.pages(size=(1, 10_000))
    assert code_of(handler, strip, replace(spec, max_pixels=10**10)) == "resource_limit"
    assert code_of(handler, strip, spec) == "resource_limit"  # max_pixels alone


def test_polyglot_is_what_its_first_bytes_say(handler: Handler) -> None:
    out = derive(handler, pdfgen.behind_jpeg(imagegen.case("jpeg_baseline")))
    assert out.original is not None
    assert (out.original.format, out.original.media) == ("jpeg", None)


def test_a_stream_is_measured_up_to_the_cap_only() -> None:
    bomb = pdfgen.object_stream_bomb(1 << 25)  # 32 MiB inflated
    assert pdf.inflates_past(bomb, (1 << 25) - 1)
    assert not pdf.inflates_past(bomb, 1 << 25)
    assert not pdf.inflates_past(pdfgen.pages(), 0)  # no compressed stream at all


def test_render_size_follows_the_variants() -> None:
    assert pdf.render_size((612, 792), SPEC.variants) == (1236, 1600)
    assert pdf.render_size((612, 792), ()) == (612, 792)
    cover = (replace(SPEC.variants[1], box=(400, 100), fit="cover"),)
    assert pdf.render_size((100, 100), cover) == (400, 400)


# -- video ------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", sorted(set(videogen.ENCODERS) - {"mpeg4"}))
def test_video_frame_skips_the_black_start(handler: Handler, codec: str) -> None:
    out = derive(handler, videogen.clip(codec))
    a = out.original
    assert a is not None and a.media is not None
    assert (a.width, a.height, a.frames) == (320, 240, 30)
    assert a.format == {"h264": "mp4", "hevc": "mov", "vp9": "webm", "av1": "mp4"}[codec]
    assert a.media["codec"] == codec and a.media["audio"] is False
    assert (a.media["duration"], a.media["frame_rate"]) == (3.0, 10.0)
    assert a.media["frame_time"] >= 1.0  # past the black second
    assert is_red(corner_pixels(picture(out))["top_left"])


@pytest.mark.parametrize(
    ("rotate", "mirror", "size", "red_at"),
    [
        (90, False, (240, 320), "bottom_left"),  # counter-clockwise: the top goes left
        (270, False, (240, 320), "top_right"),
        (180, False, (320, 240), "bottom_right"),
        (0, True, (320, 240), "top_right"),
        (90, True, (240, 320), "bottom_right"),
    ],
)
def test_display_matrix_is_applied_whole(
    handler: Handler, rotate: int, mirror: bool, size: tuple[int, int], red_at: str
) -> None:
    out = derive(handler, videogen.clip(rotate=rotate, mirror=mirror))
    assert out.original is not None
    assert (out[0].width, out[0].height) == (out.original.width, out.original.height) == size
    corners = corner_pixels(picture(out))
    assert [name for name, pixel in corners.items() if is_red(pixel)] == [red_at]


def test_turn_matches_what_numpy_does_for_each_matrix() -> None:
    """The Turn read from each display matrix PyAV writes, against np.rot90 and
    np.fliplr (what its docs say the matrix means: a counter-clockwise turn, then a
    mirror)."""
    np = numpy()
    stored = np.arange(6).reshape(2, 3, 1)
    for rotate in (0, 90, 180, 270):
        for mirror in (False, True):
            expected = np.rot90(stored, rotate // 90)
            expected = expected[:, ::-1] if mirror else expected
            turned = video.oriented(stored, _turn_written(rotate, mirror))
            assert np.array_equal(turned, expected), (rotate, mirror)


def _turn_written(rotate: int, mirror: bool) -> video.Turn:
    """The Turn of the first frame of a clip written with this rotation and mirror."""
    data = videogen.clip(seconds=0.1, black_s=0, rotate=rotate, mirror=mirror)
    with av.open(io.BytesIO(data)) as container:
        frame = next(container.decode(video=0))
        return video.display_turn(frame)


def test_audio_is_reported(handler: Handler) -> None:
    out = derive(handler, videogen.clip(audio=True))
    assert out.original is not None and out.original.media is not None
    assert out.original.media["audio"] is True


@pytest.mark.parametrize("transfer", ["pq", "hlg"])
def test_hdr_is_tone_mapped_not_washed_out(handler: Handler, transfer: str) -> None:
    out = derive(handler, videogen.hdr_clip(transfer))
    image = picture(out)
    w, h = image.size
    black = image.getpixel((1, h - 2))
    top = image.getpixel((w - 2, h - 2))
    red = image.getpixel((w // 16, h // 8))
    assert isinstance(black, tuple) and isinstance(top, tuple) and isinstance(red, tuple)
    assert max(black) < 24  # black stays black (read as SDR it would be too)
    assert min(top) > 235  # the signal's top reaches white
    assert red[0] > 150 and red[1] < 60 and red[2] < 60  # saturated, not pink-grey


def test_tone_curve_passes_sdr_and_rolls_off_highlights() -> None:
    np = numpy()
    light = np.array([[0.0, 0.0, 0.0], [0.5, 0.25, 0.1], [4.0, 4.0, 4.0], [40.0, 1.0, 1.0]])
    mapped = tonemap.compress(light)
    assert np.allclose(mapped[:2], light[:2])  # below the knee: unchanged
    assert 0.9 < mapped[2][0] < 1.0 and np.all(mapped <= 1.0)
    assert mapped[3][0] > 20 * mapped[3][1]  # hue kept: red stays red
    assert tonemap.pq_to_nits(np.array([0.0, 1.0])).round().tolist() == [0.0, 10000.0]


@pytest.mark.parametrize("name", HOSTILE_VIDEOS)
def test_hostile_video_ends_in_its_code(handler: Handler, name: str) -> None:
    make, code = HOSTILE_VIDEOS[name]
    assert code_of(handler, make()) == code


def test_stream_count_and_frame_size_limits(handler: Handler) -> None:
    with_audio = videogen.clip(audio=True)
    assert code_of(handler, with_audio, replace(SPEC, previews=PreviewSpec(max_streams=1))
                   ) == "resource_limit"  # fmt: skip
    assert code_of(handler, videogen.clip(), replace(SPEC, max_pixels=320 * 240 - 1)
                   ) == "resource_limit"  # fmt: skip
    assert derive(handler, videogen.clip(), replace(SPEC, max_pixels=320 * 240)).original


def test_both_backends_derive_the_same_previews() -> None:
    handlers = {name: create_handler(name, SPEC) for name in BACKENDS}
    for original in (pdfgen.pages(), videogen.clip(rotate=90), videogen.hdr_clip("pq")):
        vips, pillow = (derive(handlers[name], original) for name in BACKENDS)
        assert [(v.width, v.height) for v in vips] == [(v.width, v.height) for v in pillow]
        for ours, theirs in zip(vips, pillow, strict=True):
            assert mad(ours.data, theirs.data) < PARITY_MAD
        assert vips.original is not None and pillow.original is not None
        assert vips.original.media == pillow.original.media


# -- configuration ----------------------------------------------------------------------------


def test_derive_settings_reach_the_handlers_spec(tmp_path: Path) -> None:
    ini = tmp_path / "derivd.ini"
    ini.write_text("[supervisor]\nmax_worker_rss_mb = 512\n[derive]\naccept = pdf\n"
                   "max_pages = 7\npdf_page = 2\nmax_duration = 60\nmax_streams = 3\n"
                   "frame_offset = 0.5\n", encoding="utf-8")  # fmt: skip
    previews = load_config(ini, env={}).derive_spec().previews
    assert previews == PreviewSpec(accept=frozenset({"pdf"}), max_pages=7, max_duration_s=60,
                                   max_streams=3, frame_offset=0.5, pdf_page=2,
                                   memory_bytes=512 * 1024 * 1024)  # fmt: skip
    ini.write_text("[derive]\naccept = image, gif\nframe_offset = 2\n", encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_config(ini, env={})
    assert "[derive] accept: unknown kind 'gif'; kinds: image, pdf, video" in str(caught.value)
    assert "[derive] frame_offset: must be between 0 and 1" in str(caught.value)
