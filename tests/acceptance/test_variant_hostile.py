"""Hostile and odd inputs for the variant options, through `derivd run`, both backends.

The handler-level tests (tests/unit/test_variants.py) show each option on each input; this
one runs them through the whole supervisor the way production does: originals in an fs
store, rows on the test PostgreSQL, `derivd run --burst` with two workers and variant
sections that use every new option at once (a smart-cropped, upscaled 320x320 cover in
avif + webp + jpeg, an animated long-edge variant in webp + avif, a png). Inputs: a
1 x 20000 strip, CMYK and 16-bit originals, valid animations, animated bombs (thousands
of frames in a few hundred kB; huge frames in 138 bytes, within and beyond max_pixels).

Each row must end as its case says on its first attempt: ready with every variant and
format stored at the right dimensions (and frame count), or rejected with the expected
code. No timeout, retry or recycle; the workers' peak RSS (VmHWM, sampled while they run)
stays under `max_worker_rss_mb`; every derived object in the store belongs to a recorded
variant and every recorded variant is in the store (nothing lost, nothing orphaned).
"""

from __future__ import annotations

import io
from pathlib import Path

import imagegen
import pytest
from fixtures.burst import outcomes, queue_originals, run_cleanly, write_burst_ini
from PIL import Image

from derivd.queue.db import QueueDB
from derivd.storage.fs import FsStorage

MAX_WORKER_RSS_MB = 1024  # the default [supervisor] max_worker_rss_mb
SECTIONS = """
[derive]
variants = card, anim, still
[variant:card]
size = 320x320
fit = cover
gravity = attention
format = avif, webp, jpeg
upscale = yes
[variant:anim]
size = 160
format = webp, avif
animated = yes
[variant:still]
size = 200
format = png
"""
FORMATS = {"card": ("avif", "webp", "jpeg"), "anim": ("webp", "avif"), "still": ("png",)}
PIL_FORMAT = {"avif": "AVIF", "webp": "WEBP", "jpeg": "JPEG", "png": "PNG"}


def _webp_frames(count: int, size: tuple[int, int]) -> bytes:
    """An animated lossless WebP; neighbouring frames differ (identical ones are merged)."""
    frames = [Image.new("RGB", size, (0, 255 * (i % 2), 0)) for i in range(count)]
    buf = io.BytesIO()
    frames[0].save(buf, "WEBP", save_all=True, append_images=frames[1:], duration=20,
                   lossless=True)  # fmt: skip
    return buf.getvalue()


def _webp_canvas(side: int, frames: int = 2) -> bytes:
    """Two 16 x 16 frames on a side x side canvas (VP8X), 138 bytes: huge frames."""
    data = _webp_frames(frames, (16, 16))
    at = data.index(b"VP8X") + 8 + 4  # chunk header, then flags and 3 reserved bytes
    side_bytes = (side - 1).to_bytes(3, "little")
    return data[:at] + side_bytes + side_bytes + data[at + 6 :]


def strip() -> bytes:
    return imagegen._save(Image.new("RGB", (1, 20_000), (10, 200, 30)), "PNG")


# (width, height, frames) of card, anim and still for a ready case.
def _sizes(card: tuple[int, int], anim: tuple[int, int], frames: int, still: tuple[int, int]
           ) -> dict[str, tuple[int, int, int]]:  # fmt: skip
    return {"card": (*card, 1), "anim": (*anim, frames), "still": (*still, 1)}


PHOTO = _sizes((320, 320), (160, 101), 1, (200, 126))  # imagegen's 637 x 401
ANIMATION = {"gif_animated": 5, "webp_animated": 4}
LIMIT = "resource_limit"
CASES: list[tuple[str, imagegen.Factory, object]] = [
    # covered to 320x320 (upscaled), never building a 320 x 6 400 000 intermediate
    ("strip_1x20000", strip, _sizes((320, 320), (1, 160), 1, (1, 200))),
    # CMYK and 16-bit through every format
    *[(name, (lambda n=name: imagegen.case(n)), PHOTO)
      for name in ("jpeg_cmyk", "jpeg_cmyk_icc", "tiff_cmyk", "png_rgb16", "png_grey16")],
    # valid animations stay animated in webp and avif
    *[(name, (lambda n=name: imagegen.case(n)), _sizes((320, 320), (160, 120), count, (200, 150)))
      for name, count in ANIMATION.items()],
    # huge frames within max_pixels (2 x 49 MP of canvas in 138 bytes): derived
    ("webp_2_huge_frames", lambda: _webp_canvas(7000), _sizes((320, 320), (160, 160), 2,
                                                               (200, 200))),
    # animated bombs: refused from the header
    ("gif_10000_frames", imagegen.gif_10000_frames, LIMIT),
    ("webp_5000_frames", lambda: _webp_frames(5000, (1, 1)), LIMIT),
    ("gif_150_frames", imagegen.gif_many_frames, LIMIT),
    ("gif_frames_times_pixels", imagegen.gif_frames_times_pixels, LIMIT),
    ("gif_one_huge_frame", imagegen.gif_bomb, LIMIT),
    ("gif_pixel_flood", imagegen.gif_pixel_flood, LIMIT),
    ("webp_huge_canvas", lambda: _webp_canvas(16_383), LIMIT),
]  # fmt: skip


def _frames(data: bytes) -> tuple[str | None, tuple[int, int], int]:
    with Image.open(io.BytesIO(data)) as im:
        return im.format, im.size, int(getattr(im, "n_frames", 1))


@pytest.mark.acceptance
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["vips", "pillow"])
def test_variant_options_on_hostile_inputs_through_the_supervisor(
    backend: str, dsn: str, fs_root: Path, tmp_path: Path
) -> None:
    store = FsStorage(fs_root)
    ids = queue_originals(dsn, store, [make for _, make, _ in CASES])
    expected = {file_id: (name, want) for file_id, (name, _, want) in zip(ids, CASES, strict=True)}
    ini = write_burst_ini(
        tmp_path / "derivd.ini",
        dsn=dsn,
        fs_root=fs_root,
        state_dir=tmp_path / "state",
        job_timeout=120,
        max_rss_mb=MAX_WORKER_RSS_MB,
        lease=180,
        derive=SECTIONS.replace("[derive]", f"[derive]\nbackend = {backend}"),
    )
    peaks = run_cleanly(ini, tmp_path / "derivd.log")

    rows, kinds = outcomes(dsn)
    wrong, recorded = [], set()
    with QueueDB.open(dsn, role="test") as queue:
        for file_id, (name, want) in expected.items():
            status, error_code, attempts = rows[file_id]
            if attempts != 1:
                wrong.append(f"{name}: {attempts} attempts")
            if not isinstance(want, dict):
                if (status, error_code) != ("rejected", want):
                    wrong.append(f"{name}: want {want}, got {status}/{error_code}")
                continue
            if status != "ready":
                wrong.append(f"{name}: want ready, got {status}/{error_code}")
                continue
            variants = queue.file_variants(file_id)
            got = sorted((v.name, v.format) for v in variants)
            if got != sorted((n, f) for n, fs in FORMATS.items() for f in fs):
                wrong.append(f"{name}: variants {got}")
            for v in variants:
                recorded.add(v.key)
                width, height, frames = want[v.name]
                found = _frames(store.get(v.key, v.version))
                if found != (PIL_FORMAT[v.format], (width, height), frames) or (
                    v.width, v.height) != (width, height):  # fmt: skip
                    wrong.append(f"{name} {v.name}.{v.format}: {v.width}x{v.height}, {found}")
    assert not wrong, "\n".join(wrong)
    # Nothing lost, nothing orphaned: the store holds exactly the recorded variants.
    assert set(store.list_keys("derived/")) == recorded
    assert "timeout" not in kinds and "retry" not in kinds and "exhausted" not in kinds
    assert peaks and max(peaks.values()) < MAX_WORKER_RSS_MB, peaks
    print(f"{backend}: peak worker RSS {max(peaks.values()):.0f} MiB over {len(peaks)} workers")
