"""Where one image's CPU goes in derivd, step by step, for bench/sharp.py's task.

    .venv/bin/python bench/steps.py [--label after] [--repeat 15] [--jobs 240]

The 720x588 cover JPEG q80 variant of bench/sharp.py, on sharp's fixture and on one 12 MP
phone photo, both backends, one thread (as a worker). Each step is called through the
handler's own functions (`decode_original`, `derive_variants`); `--label` names the tree
in the JSON (steps-before.json was made with the handlers before issue 23, whose decode
functions had other names):

- decode + resize: sniff, header, limits and the decode to the base the variants need,
  rendered to memory (libvips streams the two together, so they are one step here);
- crop + encode: the variant shaped from that base and encoded, its SHA-256 taken
  (the original's analysis, which `derive` adds, is not in either step);
- store: the variant written to the fs store (a temporary file, fsync, rename);
- handler: the handler's whole `derive` (the analysis included); floor: sharp's own
  pipeline in the plain library (`vips_floor`, `pillow_floor`): what any program doing
  this task with that library pays, so handler minus floor is what derivd adds;
- queue: the CPU per job of `derivd run --burst` with the `noop` backend over `--jobs`
  rows (claim, fenced commit, supervisor; PostgreSQL's own CPU is not counted);
- boot: `derivd run --burst` (vips) on an empty queue with one worker, as a whole (the
  supervisor with its imports, and the worker); and one worker's own boot, fork to ready.

Median CPU (process_time) over `--repeat` runs after a warm-up; each step in isolation, so
the sum is a little above the streamed pipeline. Writes bench/out/steps-<label>.json.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from common import ROOT, burst_drain, cluster, fresh_db, save_results, table

os.environ.setdefault("VIPS_CONCURRENCY", "1")

from derivd.handlers.base import DeriveSpec, VariantSpec
from derivd.handlers.geometry import base_size, jpeg_shrink
from derivd.handlers.registry import create_handler
from derivd.storage.fs import FsStorage

VARIANT = VariantSpec("bench", box=(720, 588), fit="cover", formats=("jpeg",), quality=80)
SPEC = DeriveSpec(variants=(VARIANT,), quality=80, concurrency=1)


def cpu_ms(step: Callable[[], Any], repeat: int) -> float:
    step()
    times = []
    for _ in range(repeat):
        started = time.process_time()
        step()
        times.append((time.process_time() - started) * 1000)
    return statistics.median(times)


def vips_steps(data: bytes) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    from derivd.handlers import vips
    from derivd.handlers.vips_variants import derive_variants

    create_handler("vips", SPEC)  # configure libvips as a worker does

    def decode() -> Any:
        return vips.decode_original(data, SPEC)  # the base, rendered to memory

    def encode(decoded: Any) -> Any:
        return derive_variants(decoded.base, decoded.page_height, decoded.upright, SPEC)

    return decode, encode


def pillow_steps(data: bytes) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    from derivd.handlers import pillow
    from derivd.handlers.pillow_variants import derive_variants

    create_handler("pillow", SPEC)

    def decode() -> Any:
        return pillow.decode_original(data, SPEC)[0]

    def encode(decoded: Any) -> Any:
        return derive_variants(decoded, SPEC)

    return decode, encode


def vips_floor(data: bytes) -> bytes:
    """sharp's pipeline in plain pyvips, nothing else: the JPEG opened at sharp's
    shrink-on-load factor (geometry.jpeg_shrink, `fast`), lanczos3 to cover the box, the
    centre cut out, JPEG q80 4:2:0 with optimised Huffman tables (sharp's defaults). No
    sniffing, limits, orientation, colour management or analysis: the floor any libvips
    program doing this task stands on."""
    import pyvips

    head = pyvips.Image.jpegload_buffer(data, access="sequential")
    base = base_size(head.width, head.height, SPEC.variants)
    shrink = jpeg_shrink((head.width, head.height), base, "fast")
    image = pyvips.Image.jpegload_buffer(data, shrink=shrink, access="sequential")
    image = image.thumbnail_image(base[0], height=base[1], size="force")
    box = VARIANT.bounds
    image = image.crop((base[0] - box[0]) // 2, (base[1] - box[1]) // 2, *box)
    return bytes(image.jpegsave_buffer(Q=80, subsample_mode="on", optimize_coding=True,
                                       keep="none"))  # fmt: skip


def pillow_floor(data: bytes) -> bytes:
    """The same in plain Pillow: draft at the same factor, Lanczos, centre cut, save."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        base = base_size(*im.size, SPEC.variants)
        shrink = jpeg_shrink(im.size, base, "fast")
        im.draft("RGB", (im.size[0] // shrink, im.size[1] // shrink))
        image = im.resize(base, Image.Resampling.LANCZOS)
    box = VARIANT.bounds
    left, top = (base[0] - box[0]) // 2, (base[1] - box[1]) // 2
    out = io.BytesIO()
    image.crop((left, top, left + box[0], top + box[1])).save(
        out, "JPEG", quality=80, subsampling=2, optimize=True
    )
    return out.getvalue()


def handler_rows(inputs: dict[str, bytes], repeat: int, store: FsStorage) -> list[dict[str, Any]]:
    rows = []
    floors = {"vips": vips_floor, "pillow": pillow_floor}
    for backend, steps in (("vips", vips_steps), ("pillow", pillow_steps)):
        for name, data in inputs.items():
            decode, encode = steps(data)
            decoded = decode()
            (out,) = encode(decoded)
            whole = create_handler(backend, SPEC)
            rows.append({
                "backend": backend, "input": name,
                "decode_resize_ms": cpu_ms(decode, repeat),
                "crop_encode_ms": cpu_ms(lambda: encode(decoded), repeat),  # noqa: B023
                "sha256_ms": cpu_ms(lambda: hashlib.sha256(out.data).hexdigest(), repeat),  # noqa: B023
                "store_ms": cpu_ms(lambda: store.put("derived/1/x/bench.jpg", out.data,  # noqa: B023
                                                     "image/jpeg"), repeat),
                "handler_ms": cpu_ms(lambda: whole.derive(data, SPEC), repeat),  # noqa: B023
                "floor_ms": cpu_ms(lambda: floors[backend](data), repeat),  # noqa: B023
            })  # fmt: skip
    return rows


def queue_and_boot(jobs: int, work: Path) -> dict[str, float]:
    with cluster() as pg:
        dsn = fresh_db(pg, "steps")
        inis = {}
        for backend in ("vips", "noop"):
            inis[backend] = work / f"derivd-{backend}.ini"
            inis[backend].write_text(
                f"[database]\ndsn = {dsn}\n[storage]\nbackend = fs\nroot = {work / 'o'}\n"
                f"[supervisor]\nworkers = 1\nstate_dir = {work / 'state'}\n"
                f"[derive]\nbackend = {backend}\n", encoding="utf-8")  # fmt: skip
        boot = burst_drain(inis["vips"], work / "boot.log", dsn)
        idle = burst_drain(inis["noop"], work / "idle.log", dsn)
        found = re.search(r"boot_cpu_s=([0-9.]+)", (work / "boot.log").read_text())
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO archive_files (status, original_key, original_version)"
                         " SELECT 'queued', 'originals/x' || n, 'v' FROM generate_series(1, %s) n",
                         (jobs,))  # fmt: skip
        drained = burst_drain(inis["noop"], work / "noop.log", dsn)
    return {"boot_run_cpu_s": boot.cpu_s, "boot_run_wall_s": boot.wall_s,
            "worker_boot_cpu_s": float(found.group(1)) if found else float("nan"),
            "queue_ms_per_job": (drained.cpu_s - idle.cpu_s) / jobs * 1000}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="after")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--jobs", type=int, default=240)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from sharp import FIXTURE_NAME, HOME, phone_photos

    phone = phone_photos(ROOT / "bench" / "out" / "sharp-inputs")[0]
    inputs = {
        "sharp fixture": (HOME / FIXTURE_NAME).read_bytes(),
        "phone 12 MP": phone.read_bytes(),
    }
    with tempfile.TemporaryDirectory(prefix="derivd-steps-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        rows = handler_rows(inputs, args.repeat, FsStorage(work / "store"))
        fleet = queue_and_boot(args.jobs, work)
    load = os.getloadavg()[0]
    print(f"{args.label}: load {load:.1f}; queue {fleet['queue_ms_per_job']:.2f} CPU ms/job; "
          f"run --burst on an empty queue {fleet['boot_run_cpu_s']:.3f} CPU s "
          f"(one worker's boot {fleet['worker_boot_cpu_s']:.3f})")  # fmt: skip
    keys = ["decode_resize_ms", "crop_encode_ms", "sha256_ms", "store_ms", "handler_ms",
            "floor_ms"]  # fmt: skip
    print(table(["backend", "input", *keys], [[r["backend"], r["input"], *(r[k] for k in keys)]
                                               for r in rows]))  # fmt: skip
    path = save_results(f"steps-{args.label}", {"label": args.label, "load_1min": load,
                                                 "rows": rows, **fleet})  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
