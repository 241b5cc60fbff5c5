"""Benchmark the image handlers against the plain per-variant library call.

    .venv/bin/python bench/derive.py [--repeat N] [--out bench/out/derive.json]

Three variants (1600 inside WebP, 320x320 cover WebP, 1200x630 cover JPEG) on a JPEG, a
PNG with alpha, a TIFF and a WebP, both backends. "ours" is the handler (one decode at the
scale the largest variant needs, every variant from it); "plain" is the naive code an
application would write: per variant, one library call that decodes, resizes (or
crops) and encodes (`thumbnail_buffer` with `crop=centre` for libvips; open, `draft`,
`ImageOps.fit`/`thumbnail`, save for Pillow).

Each cell runs in a fresh subprocess: the median CPU time (process_time: every thread of
the process) and wall time of one derivation (all variants) over N runs after one
warm-up, and the peak RSS of that subprocess (VmHWM from /proc/self/status, read by the
child at its end; the interpreter and imports count on both sides alike). Not ru_maxrss:
Linux carries the forking parent's peak across exec into it, which would hide the child's
own. libvips runs with concurrency 1 on both sides, as a worker does. The ratio is of CPU
times: on a shared machine (load average 15-18 on 2 cores while these ran) wall times
swing 2x between identical runs, CPU times by ~10%.
The table is printed and written as JSON (for plots).
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
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]

# (name, width, height, fit, format)
VARIANTS = (
    ("preview", 1600, 1600, "inside", "webp"),
    ("card", 320, 320, "cover", "webp"),
    ("og", 1200, 630, "cover", "jpeg"),
)
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
        save("12MP.tiff", imagegen.scene(4240, 2832), "TIFF", compression="tiff_lzw"),
    ]


# --- the work, in the child ------------------------------------------------------------------


def _handler(backend: str) -> Callable[[bytes], object]:
    from derivd.handlers.base import DeriveSpec, VariantSpec
    from derivd.handlers.registry import create_handler

    spec = DeriveSpec(
        variants=tuple(
            VariantSpec(n, box=(w, h), fit=fit, formats=(fmt,)) for n, w, h, fit, fmt in VARIANTS
        ),
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

    def one(data: bytes, width: int, height: int, fit: str, fmt: str) -> bytes:
        crop = {"crop": "centre"} if fit == "cover" else {}
        image = pyvips.Image.thumbnail_buffer(data, width, height=height, size="down", **crop)
        if fmt == "jpeg":
            flat = image.flatten(background=[255, 255, 255]) if image.hasalpha() else image
            return flat.jpegsave_buffer(Q=QUALITY, keep="none")  # type: ignore[no-any-return]
        return image.webpsave_buffer(Q=QUALITY, effort=EFFORT, keep="none")  # type: ignore[no-any-return]

    return lambda data: [one(data, w, h, fit, fmt) for _, w, h, fit, fmt in VARIANTS]


def _pillow_plain() -> Callable[[bytes], object]:
    from PIL import Image, ImageOps

    def one(data: bytes, width: int, height: int, fit: str, fmt: str) -> bytes:
        with Image.open(io.BytesIO(data)) as im:
            im.draft("RGB", (width, height))
            image = ImageOps.exif_transpose(im)
            if fit == "cover":
                image = ImageOps.fit(image, (width, height), Image.Resampling.LANCZOS)
            else:
                image.thumbnail((width, height), Image.Resampling.LANCZOS, reducing_gap=3.0)
            buf = io.BytesIO()
            if fmt == "jpeg":
                image.convert("RGB").save(buf, "JPEG", quality=QUALITY)
            else:
                image.save(buf, "WEBP", quality=QUALITY, method=EFFORT)
            return buf.getvalue()

    return lambda data: [one(data, w, h, fit, fmt) for _, w, h, fit, fmt in VARIANTS]


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
    times, cpu = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        run(data)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    print(json.dumps({"median_s": statistics.median(times), "cpu_s": statistics.median(cpu),
                      "peak_kib": _vm_hwm_kib(), "idle_kib": idle_kib}))  # fmt: skip


def _vm_hwm_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


# --- the parent ------------------------------------------------------------------------------


def measure(mode: str, path: Path, repeat: int) -> tuple[float, float, float, float]:
    env = {**os.environ, "VIPS_CONCURRENCY": "1"}
    cmd = [sys.executable, __file__, "--child", mode, str(path), "--repeat", str(repeat)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} on {path.name} failed ({proc.returncode})")
    result = json.loads(proc.stdout)
    return result["cpu_s"], result["median_s"], result["peak_kib"] / 1024, result["idle_kib"] / 1024


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
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "derive.json")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.repeat)
        return
    print(versions())
    print(f"variants={VARIANTS} quality={QUALITY} effort={EFFORT} median of {args.repeat}")
    header = f"{'input':16} {'backend':7} {'ours cpu ms':>11} {'plain cpu ms':>12} {'ratio':>6}"
    print(header + f" {'ours wall':>9} {'plain wall':>10} {'ours MiB':>9} {'plain MiB':>10}"
          f" {'idle MiB':>9}")  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in make_inputs(Path(tmp)):
            for backend in ("vips", "pillow"):
                ours_t, ours_w, ours_m, idle_m = measure(backend, path, args.repeat)
                plain_t, plain_w, plain_m, _ = measure(f"{backend}-plain", path, args.repeat)
                print(
                    f"{name:16} {backend:7} {ours_t * 1000:11.0f} {plain_t * 1000:12.0f}"
                    f" {ours_t / plain_t:6.2f} {ours_w * 1000:9.0f} {plain_w * 1000:10.0f}"
                    f" {ours_m:9.0f} {plain_m:10.0f} {idle_m:9.0f}",
                    flush=True,
                )
                rows.append({"input": name, "backend": backend, "ours_cpu_ms": ours_t * 1000,
                             "plain_cpu_ms": plain_t * 1000, "ratio": ours_t / plain_t,
                             "ours_wall_ms": ours_w * 1000, "plain_wall_ms": plain_w * 1000,
                             "ours_peak_mib": ours_m, "plain_peak_mib": plain_m,
                             "idle_mib": idle_m})  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "bench": "derive", "versions": versions(), "repeat": args.repeat,
        "variants": [dict(zip(("name", "width", "height", "fit", "format"), v, strict=True))
                     for v in VARIANTS],
        "quality": QUALITY, "effort": EFFORT, "rows": rows}, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
