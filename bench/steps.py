"""Where one image's CPU goes in derivd, step by step, for bench/sharp.py's task.

    .venv/bin/python bench/steps.py [--label after] [--repeat 15] [--jobs 240]
    .venv/bin/python bench/steps.py --floor vips|pillow [--lanes N] --out DIR --result JSON INPUT...

The 720x588 cover JPEG q80 variant of bench/sharp.py, on sharp's fixture and on one 12 MP
phone photo, both backends, one thread (as a worker). Each step is called through the
handler's own functions (`decode_original`, `derive_variants`); `--label` names the tree
in the JSON:

- decode + resize: sniff, header, limits and the decode to the base the variants need,
  rendered to memory (libvips streams the two together, so they are one step here);
- crop + encode: the variant shaped from that base and encoded, its SHA-256 taken
  (the original's analysis, which `derive` adds, is not in either step);
- store: the variant written to the fs store (a temporary file, fsync, rename);
- handler: the handler's whole `derive` (the analysis included); floor: sharp's own
  pipeline in the plain library (`vips_floor`, `pillow_floor`): what any program doing
  this task with that library pays; floor_scaled: the same at derivd's decode scale
  (libjpeg-turbo at M/8, `vips_floor_scaled`, `pillow_floor_scaled`), so handler minus
  floor_scaled is what derivd adds;
- queue: the CPU per job of `derivd run --burst` with the `noop` backend over `--jobs`
  rows (claim, fenced commit, supervisor; PostgreSQL's own CPU is not counted);
- boot: `derivd run --burst` (vips) on an empty queue with one worker, as a whole (the
  supervisor with its imports, and the worker); and one worker's own boot, fork to ready.

Median CPU (process_time) over `--repeat` runs after a warm-up; each step in isolation, so
the sum is a little above the streamed pipeline. Writes bench/out/steps-<label>.json.
`--floor` only runs the scaled floor over INPUTS in `--lanes` processes at once (one per
core, outputs in DIR): bench/sharp.py's `floor:` sides, the work alone timed (the lanes'
imports are not: `floor_task`), written to `--result` as JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import statistics
import subprocess
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
from derivd.handlers.geometry import base_size, jpeg_eighths, jpeg_shrink
from derivd.handlers.pillow_variants import save_jpeg
from derivd.handlers.registry import create_handler
from derivd.osproc import keep_freed_heap
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


def _turbo(data: bytes, colour: str, turn: int
           ) -> tuple[Any, tuple[int, int], tuple[float, float]]:  # fmt: skip
    """libjpeg-turbo's decode (simplejpeg) at the M/8 scale derivd picks for the task
    (`geometry.jpeg_eighths`, `fast`, for the upright size: EXIF orientation `turn`), as
    `colour` (RGB, or RGBX for Pillow): the pixels, the base as stored (not yet upright),
    and the part of the pixels the image spans (jpegscale.Scaled.extent)."""
    import simplejpeg

    height, width = simplejpeg.decode_jpeg_header(data)[:2]
    sideways = turn in (5, 6, 7, 8)
    upright = (height, width) if sideways else (width, height)
    base = base_size(*upright, SPEC.variants)
    eighths = jpeg_eighths(upright, base, "fast")
    least = (-(-width * eighths // 8), -(-height * eighths // 8)) if eighths < 8 else (0, 0)
    pixels = simplejpeg.decode_jpeg(data, colorspace=colour, min_width=least[0],
                                    min_height=least[1])  # fmt: skip
    stored_way = (base[1], base[0]) if sideways else base
    return pixels, stored_way, (width * eighths / 8, height * eighths / 8)


def vips_floor_scaled(data: bytes) -> bytes:
    """`vips_floor` at derivd's scale: libjpeg-turbo at M/8 (3/8 for sharp's fixture,
    where sharp decodes at 1/2), then libvips' lanczos3 at the exact scale, turned
    upright, the centre cut, and the JPEG writer of both backends (`save_jpeg`:
    libjpeg-turbo's through Pillow since 5d0c83a; pyvips-binary's jpegsave is mozjpeg,
    ~1.5x the CPU). What derivd's vips handler does to the pixels, and nothing else (no
    sniffing, limits, colour management or analysis)."""
    import pyvips

    from derivd.handlers.vips_variants import to_pillow

    head = pyvips.Image.new_from_buffer(data, "", access="sequential")
    turn = head.get("orientation") if head.get_typeof("orientation") else 1
    pixels, base, extent = _turbo(data, "RGB", turn)
    image = pyvips.Image.new_from_memory(pixels.data, pixels.shape[1], pixels.shape[0], 3,
                                         "uchar")  # fmt: skip
    whole = (min(image.width, round(extent[0])), min(image.height, round(extent[1])))
    image = image.crop(0, 0, *whole).resize(base[0] / extent[0], vscale=base[1] / extent[1])
    image = image.crop(0, 0, *base).copy()
    image.set_type(pyvips.GValue.gint_type, "orientation", turn)
    image = image.autorot()
    box = VARIANT.bounds
    image = image.crop((image.width - box[0]) // 2, (image.height - box[1]) // 2, *box)
    return save_jpeg(to_pillow(image), VARIANT.quality)


_TURNS = {3: 3, 6: 4, 8: 2}  # EXIF orientation -> PIL.Image.Transpose (180, 270, 90)


def pillow_floor_scaled(data: bytes) -> bytes:
    """`pillow_floor` at derivd's scale: libjpeg-turbo at M/8, Pillow's Lanczos from the
    exact part of the pixels the image spans, turned upright, the centre cut, the same
    save."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as head:
        turn = head.getexif().get(0x0112, 1)
    pixels, base, extent = _turbo(data, "RGBX", turn)
    size = (pixels.shape[1], pixels.shape[0])
    image = Image.frombuffer("RGBX", size, pixels, "raw", "RGBX", 0, 1)
    image = image.resize(base, Image.Resampling.LANCZOS, box=(0, 0, *extent)).convert("RGB")
    if turn in _TURNS:
        image = image.transpose(Image.Transpose(_TURNS[turn]))
    box = VARIANT.bounds
    left, top = (image.width - box[0]) // 2, (image.height - box[1]) // 2
    return save_jpeg(image.crop((left, top, left + box[0], top + box[1])), VARIANT.quality)


FLOORS = {"vips": vips_floor, "pillow": pillow_floor}
FLOORS_SCALED = {"vips": vips_floor_scaled, "pillow": pillow_floor_scaled}


def floor_task(backend: str, lanes: int, out: Path, inputs: list[Path], result: Path) -> None:
    """`lanes` processes (one per core, as sharp's per-core mode), each the scaled floor
    over its share of `inputs` one after another, outputs written to `out` as NNNN.jpg:
    the plain-library floor, for bench/sharp.py. Only the work is timed: every lane
    imports what it needs (this module, the libraries) and says so, then all start
    together; wall is from that start to the last lane's end, CPU each lane's own from
    its start (getrusage, its libvips threads included), peak RSS the largest lane's.
    Written to `result` as JSON (wall_s, cpu_s, peak_rss_mb)."""
    lane = [sys.executable, __file__, "--floor", backend, "--out", str(out)]
    children = [subprocess.Popen([*lane, "--lane", f"{k}/{lanes}", *map(str, inputs)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                for k in range(lanes)]  # fmt: skip
    for child in children:  # every lane imported: nothing below waits on an import
        if child.stdout is None or child.stdout.readline().strip() != "ready":
            raise SystemExit("a floor lane failed before its first image")
    started = time.perf_counter()
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.close()
    # Each lane's report is its last line; its interpreter's exit after it is not timed.
    reports = [child.stdout.readline() for child in children if child.stdout is not None]
    wall = time.perf_counter() - started
    if any(child.wait() for child in children):
        raise SystemExit("a floor lane failed")
    lanes_done = [json.loads(report) for report in reports]
    result.write_text(json.dumps({
        "wall_s": wall, "cpu_s": sum(r["cpu_s"] for r in lanes_done),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in lanes_done),
    }))  # fmt: skip


def floor_lane(backend: str, lane: str, out: Path, inputs: list[Path]) -> None:
    """One lane of `floor_task`: import, say `ready`, wait for `go`, then the images;
    its CPU from `go` to the end and its peak RSS as one JSON line on stdout."""
    index, lanes = map(int, lane.split("/"))
    floor = FLOORS_SCALED[backend]
    # The allocator setting every derivd worker runs with (8258933): a process setting,
    # not work around the pixels; without it the floor maps and faults in each image's
    # buffers anew (~15 % of plain Pillow's CPU here), which derivd does not.
    keep_freed_heap()
    _import_floor_libraries(backend)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("floor lane: no go")
    before = _cpu_s()
    for n in range(index, len(inputs), lanes):
        (out / f"{n:04d}.jpg").write_bytes(floor(inputs[n].read_bytes()))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"cpu_s": _cpu_s() - before, "peak_rss_mb": usage.ru_maxrss / 1024}))


def _import_floor_libraries(backend: str) -> None:
    """What the floor functions import inside (numpy comes with simplejpeg)."""
    import simplejpeg  # noqa: F401
    from PIL import Image  # noqa: F401

    if backend == "vips":
        import pyvips  # noqa: F401


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def handler_rows(inputs: dict[str, bytes], repeat: int, store: FsStorage) -> list[dict[str, Any]]:
    rows = []
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
                "floor_ms": cpu_ms(lambda: FLOORS[backend](data), repeat),  # noqa: B023
                "floor_scaled_ms": cpu_ms(lambda: FLOORS_SCALED[backend](data),  # noqa: B023
                                          repeat),
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
    parser.add_argument(
        "--floor",
        choices=sorted(FLOORS_SCALED),
        help="only run the scaled floor over INPUTS (bench/sharp.py's floor side)",
    )
    parser.add_argument("--lanes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--lane", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--result", type=Path, help="--floor: where its JSON timing goes")
    parser.add_argument("inputs", nargs="*", type=Path)
    args = parser.parse_args()
    if args.floor:
        if args.lane:
            floor_lane(args.floor, args.lane, args.out, args.inputs)
        else:
            floor_task(args.floor, args.lanes, args.out, args.inputs, args.result)
        return
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
            "floor_ms", "floor_scaled_ms"]  # fmt: skip
    print(table(["backend", "input", *keys], [[r["backend"], r["input"], *(r[k] for k in keys)]
                                               for r in rows]))  # fmt: skip
    path = save_results(f"steps-{args.label}", {"label": args.label, "load_1min": load,
                                                 "rows": rows, **fleet})  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
