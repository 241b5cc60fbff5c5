"""Writes the synthetic files of this folder (see README.md); not run by the tests.

Needs pillow-heif (it has the HEVC encoder that derivd's pi-heif leaves out), in a
throwaway virtual environment: `python -m venv /tmp/gen && /tmp/gen/bin/pip install
pillow-heif && /tmp/gen/bin/python tests/corpus/heic/make_synthetic.py`. The pictures are
tests/support/imagegen.py's scene, so these files are the project's own (MIT).
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pillow_heif
from PIL import Image

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "support"))
import imagegen  # noqa: E402


def heic(images: list[Image.Image], **params: object) -> bytes:
    buf = io.BytesIO()
    heif = pillow_heif.from_pillow(images[0])
    for more in images[1:]:
        heif.add_from_pillow(more)
    heif.save(buf, quality=70, **params)
    return buf.getvalue()


def patch_ispe(data: bytes, width: int, height: int) -> bytes:
    """Every `ispe` property says width x height: the header of a huge image."""
    out = bytearray(data)
    at = out.find(b"ispe")
    while at >= 0:
        out[at + 8 : at + 16] = width.to_bytes(4, "big") + height.to_bytes(4, "big")
        at = out.find(b"ispe", at + 4)
    return bytes(out)


def many_tiles() -> bytes:
    """A 512 x 1024 grid of 2048 tiles of 16 x 16: few pixels, thousands of decodes.
    pillow-heif refuses more than 1000 items (libheif's reading limit); lift its check."""
    original = pillow_heif.misc.CtxEncode.__init__

    def unlimited(self: object, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)
        self._items_count = -(10**9)  # type: ignore[attr-defined]

    pillow_heif.misc.CtxEncode.__init__ = unlimited  # type: ignore[method-assign]
    try:
        return heic([imagegen.scene(512, 1024)], tile_size=16)
    finally:
        pillow_heif.misc.CtxEncode.__init__ = original  # type: ignore[method-assign]


def main() -> None:
    scene = imagegen.scene()
    small = heic([scene])
    files = {
        # five top-level images, the first primary: a burst
        "burst_5.heic": heic([imagegen.scene(320, 200).rotate(15 * i) for i in range(5)]),
        # cut inside the HEVC data of a valid file
        "truncated.heic": small[: len(small) * 6 // 10],
        # bombs: the header of a 200 MP image; 1000 frames; 2048 tiles
        "bomb_200mp.heic": patch_ispe(heic([imagegen.scene(64, 64)]), 20_000, 10_000),
        "bomb_1000_frames.heic": heic(
            [Image.new("RGB", (8, 8), (i % 256, 0, 0)) for i in range(1000)]
        ),
        "bomb_2048_tiles.heic": many_tiles(),
        # an image item whose codec this build has no decoder for (VVC)
        "no_decoder_vvc.heif": heic([imagegen.scene(64, 64)]).replace(b"hvc1", b"vvc1"),
    }
    for name, data in files.items():
        (HERE / name).write_bytes(data)
        print(f"{name}: {len(data)} bytes")


if __name__ == "__main__":
    main()
