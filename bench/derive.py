"""Benchmark the image handlers against the plain library call doing the same work.

    .venv/bin/python bench/derive.py [--repeat N]

For a few realistic generated inputs and both backends, runs our handler and the plain
library call (same variants, same WebP parameters) each in a fresh subprocess: the median
wall time of one derivation (all variants) over N runs after one warm-up, and the peak RSS
of that subprocess (VmHWM from /proc/self/status, read by the child at its end; the
interpreter and imports count on both sides alike). Not ru_maxrss: Linux carries the
forking parent's peak across exec into it, which would hide the child's own.
libvips runs with concurrency 1 on both sides, as a worker does.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

VARIANTS = (("preview", 1600), ("thumb", 320))
QUALITY, EFFORT = 80, 4
MODES = ("vips", "vips-plain", "pillow", "pillow-plain")


# --- inputs (parent only) ----------------------------------------------------------------------


def make_inputs(directory: Path) -> list[tuple[str, Path]]:
    import imagegen
    from PIL import Image

    def save(name: str, im: Image.Image, fmt: str, **params: object) -> tuple[str, Path]:
        path = directory / name
        im.save(path, fmt, **params)
        return name, path

    return [
        save("24MP.jpg", imagegen.scene(6000, 4000), "JPEG", quality=90),
        save(
            "12MP-alpha.png",
            imagegen.with_alpha(imagegen.scene(4240, 2832)),
            "PNG",
            compress_level=6,
        ),
        save("4K.webp", imagegen.scene(3840, 2160), "WEBP", quality=90),
        save(
            "12MP-progressive.jpg", imagegen.scene(4000, 3000), "JPEG", quality=90, progressive=True
        ),
    ]


# --- the work, in the child ------------------------------------------------------------------


def _handler(backend: str) -> Callable[[bytes], object]:
    from derivd.handlers.base import DeriveSpec, VariantSpec
    from derivd.handlers.registry import create_handler

    spec = DeriveSpec(
        variants=tuple(VariantSpec(n, e) for n, e in VARIANTS),
        quality=QUALITY,
        effort=EFFORT,
        concurrency=1,
    )
    handler = create_handler(backend, spec)
    return lambda data: handler.derive(data, spec)


def _vips_plain() -> Callable[[bytes], object]:
    import pyvips

    pyvips.cache_set_max(0)
    pyvips.concurrency_set(1)

    def run(data: bytes) -> object:
        return [
            pyvips.Image.thumbnail_buffer(data, edge, height=edge, size="down").webpsave_buffer(
                Q=QUALITY, effort=EFFORT, keep="none"
            )
            for _, edge in VARIANTS
        ]

    return run


def _pillow_plain() -> Callable[[bytes], object]:
    from PIL import Image, ImageOps

    def run(data: bytes) -> object:
        with Image.open(io.BytesIO(data)) as im:
            edge = max(e for _, e in VARIANTS)
            im.draft("RGB", (edge, edge))
            base = ImageOps.exif_transpose(im)
            out = []
            for _, edge in VARIANTS:
                small = base.copy()
                small.thumbnail((edge, edge), Image.Resampling.LANCZOS, reducing_gap=3.0)
                buf = io.BytesIO()
                small.save(buf, "WEBP", quality=QUALITY, method=EFFORT)
                out.append(buf.getvalue())
            return out

    return run


def child(mode: str, path: str, repeat: int) -> None:
    run = {
        "vips": lambda: _handler("vips"),
        "pillow": lambda: _handler("pillow"),
        "vips-plain": _vips_plain,
        "pillow-plain": _pillow_plain,
    }[mode]()
    idle_kib = _vm_hwm_kib()  # interpreter, libraries, handler: before any image
    data = Path(path).read_bytes()
    run(data)  # warm-up: first-call costs (plugin init, thread pool) are not per-image
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run(data)
        times.append(time.perf_counter() - start)
    print(
        json.dumps(
            {"median_s": statistics.median(times), "peak_kib": _vm_hwm_kib(), "idle_kib": idle_kib}
        )
    )


def _vm_hwm_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


# --- the parent ------------------------------------------------------------------------------


def measure(mode: str, path: Path, repeat: int) -> tuple[float, float, float]:
    env = {**os.environ, "VIPS_CONCURRENCY": "1"}
    cmd = [sys.executable, __file__, "--child", mode, str(path), "--repeat", str(repeat)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} on {path.name} failed ({proc.returncode})")
    result = json.loads(proc.stdout)
    return result["median_s"], result["peak_kib"] / 1024, result["idle_kib"] / 1024


def versions() -> str:
    import PIL
    import pyvips

    return (
        f"cpus={os.cpu_count()} python={sys.version.split()[0]} Pillow={PIL.__version__} "
        f"pyvips={pyvips.__version__} libvips={pyvips.version(0)}.{pyvips.version(1)}."
        f"{pyvips.version(2)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.repeat)
        return
    print(versions())
    print(f"variants={VARIANTS} quality={QUALITY} effort={EFFORT} median of {args.repeat}")
    header = f"{'input':22} {'backend':7} {'ours ms':>8} {'plain ms':>9} {'ratio':>6}"
    print(header + f" {'ours MiB':>9} {'plain MiB':>10} {'idle MiB':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in make_inputs(Path(tmp)):
            for backend in ("vips", "pillow"):
                ours_t, ours_m, idle_m = measure(backend, path, args.repeat)
                plain_t, plain_m, _ = measure(f"{backend}-plain", path, args.repeat)
                print(
                    f"{name:22} {backend:7} {ours_t * 1000:8.0f} {plain_t * 1000:9.0f}"
                    f" {ours_t / plain_t:6.2f} {ours_m:9.0f} {plain_m:10.0f} {idle_m:9.0f}"
                )


if __name__ == "__main__":
    main()
