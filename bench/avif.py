"""AVIF vs WebP at the pinned encoder settings, both backends: encode time and bytes.

    .venv/bin/python bench/avif.py [--repeat 3]

For each output size (1600 and 320 long edge, and a 1200x630 cover) and backend, the
handler derives one variant from a photo-like 12 MP JPEG in WebP and then in AVIF (quality
80, `[derive] effort` 4: WebP effort 4, AVIF effort 2 = aom cpu-used 7, see
derivd/handlers/outputs.py). Times are whole derivations (median of N after a warm-up);
decode and resize are the same for both formats, so the difference is the encode. libvips
runs with concurrency 1, Pillow's AVIF encoder with one thread, as in a worker.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

os.environ.setdefault("VIPS_CONCURRENCY", "1")

SIZES = (("1600", (1600, 1600), "inside"), ("320", (320, 320), "inside"),
         ("1200x630", (1200, 630), "cover"))  # fmt: skip
QUALITY, EFFORT = 80, 4


def photo() -> bytes:
    import imagegen
    from PIL import Image

    scene = imagegen.scene(4240, 2832)
    grain = Image.effect_noise(scene.size, 32).convert("RGB")
    buf = io.BytesIO()
    Image.blend(scene, grain, 0.25).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def timed(backend: str, data: bytes, box: tuple[int, int], fit: str, fmt: str, repeat: int
          ) -> tuple[float, int]:  # fmt: skip
    from derivd.handlers.base import DeriveSpec, VariantSpec
    from derivd.handlers.registry import create_handler

    spec = DeriveSpec(variants=(VariantSpec("v", box=box, fit=fit, formats=(fmt,)),),
                      quality=QUALITY, effort=EFFORT, concurrency=1)  # fmt: skip
    handler = create_handler(backend, spec)
    out = handler.derive(data, spec)  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        out = handler.derive(data, spec)
        times.append(time.perf_counter() - start)
    return statistics.median(times), len(out[0].data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "avif.json")
    args = parser.parse_args()
    data = photo()
    rows = []
    print(f"{'backend':7} {'size':9} {'webp ms':>8} {'avif ms':>8} {'avif/webp':>9} "
          f"{'webp B':>8} {'avif B':>8} {'bytes':>6}")  # fmt: skip
    for backend in ("vips", "pillow"):
        for label, box, fit in SIZES:
            webp_s, webp_b = timed(backend, data, box, fit, "webp", args.repeat)
            avif_s, avif_b = timed(backend, data, box, fit, "avif", args.repeat)
            rows.append({"backend": backend, "size": label, "fit": fit,
                         "webp_ms": webp_s * 1000, "avif_ms": avif_s * 1000,
                         "webp_bytes": webp_b, "avif_bytes": avif_b})  # fmt: skip
            print(f"{backend:7} {label:9} {webp_s * 1000:8.0f} {avif_s * 1000:8.0f} "
                  f"{avif_s / webp_s:9.2f} {webp_b:8d} {avif_b:8d} {avif_b / webp_b:6.2f}",
                  flush=True)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bench": "avif", "quality": QUALITY, "effort": EFFORT,
                                    "input": "12 MP photo-like JPEG", "rows": rows},
                                   indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
