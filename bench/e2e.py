"""End to end: the whole daemon against a naive process-pool loop of the same library.

    .venv/bin/python bench/e2e.py [--images 24] [--rounds 3] [--workers 2]
        [--backends vips pillow] [--concurrency 1] [--naive-concurrency 0]

A mixed set of photo-like originals (8-24 MP JPEG, 8-12 MP PNG: a scene with grain, so the
encoders have texture to work on) is derived with the default variants
(`preview:1600, thumb:320`, WebP quality 80 effort 4) by both sides, `--rounds` times per
backend (odd rounds run derivd first, so neither side always gets the quieter minutes of
a shared machine):

- derivd: `derivd run --burst` with `[supervisor] workers = N`: the queue on an embedded
  PostgreSQL (fsync on), the fs store (each object fsynced), fenced commits, the lot;
  `[derive] concurrency` libvips threads per worker (`--concurrency`, derivd's default 1).
  Time: first claim to last finish, from the rows (database clock).
- naive: a `multiprocessing.Pool(N)` mapping one function over the files: per variant,
  one library call that decodes, resizes and encodes (libvips `thumbnail_buffer` +
  `webpsave_buffer`; Pillow open, `draft`, `thumbnail`, save), output written to a file;
  libvips at `--naive-concurrency` threads per process (0, the default: libvips' own
  default, one per core). Time: the map, after the pool started.

Same cores, same images, same encoder settings. Also reported: the CPU seconds each side's
processes used (getrusage of waited-for children; derivd's boot and the naive pool's
start-up included, PostgreSQL's own CPU not), and the 1-minute load average around each
run: on a shared machine the wall-clock ratio swings with the neighbours' load, the CPU
ratio much less. Prints every round and each backend's median; writes JSON (the median
round per backend under "results", every round under "rounds").
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import ROOT, burst_drain, cluster, fresh_db, machine, store_and_queue, table

VARIANTS = (("preview", 1600), ("thumb", 320))
QUALITY, EFFORT = 80, 4
# (megapixels, width, height, format): cycled to make the set.
SHAPES = (
    (24, 6000, 4000, "JPEG"),
    (12, 4240, 2832, "PNG"),
    (8, 3464, 2309, "JPEG"),
    (16, 4899, 3266, "JPEG"),
    (8, 2309, 3464, "PNG"),
    (12, 4240, 2832, "JPEG"),
)


def make_inputs(folder: Path, count: int) -> list[Path]:
    """Photo-like originals, cached in `folder` between runs."""
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    import imagegen
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for n in range(count):
        _mp, width, height, fmt = SHAPES[n % len(SHAPES)]
        path = folder / f"{n:03d}-{width}x{height}.{fmt.lower()}"
        paths.append(path)
        if path.exists():
            continue
        rng = random.Random(n)
        scene = imagegen.scene(width, height)
        grain = Image.effect_noise((width, height), 24 + rng.randrange(16)).convert("RGB")
        photo = Image.blend(scene, grain, 0.25)
        photo.save(path, fmt, **({"quality": 90} if fmt == "JPEG" else {"compress_level": 6}))
    return paths


# --- naive loop ---------------------------------------------------------------------------


def _naive_vips(path: str, out: str) -> None:
    import pyvips

    data = Path(path).read_bytes()
    for name, edge in VARIANTS:
        image = pyvips.Image.thumbnail_buffer(data, edge, height=edge, size="down")
        Path(f"{out}.{name}.webp").write_bytes(
            image.webpsave_buffer(Q=QUALITY, effort=EFFORT, keep="none")
        )


def _naive_pillow(path: str, out: str) -> None:
    from PIL import Image, ImageOps

    data = Path(path).read_bytes()
    for name, edge in VARIANTS:
        with Image.open(io.BytesIO(data)) as im:
            im.draft("RGB", (edge, edge))
            image = ImageOps.exif_transpose(im)
            image.thumbnail((edge, edge), Image.Resampling.LANCZOS, reducing_gap=3.0)
            image.save(f"{out}.{name}.webp", "WEBP", quality=QUALITY, method=EFFORT)


def _naive_task(args: tuple[str, str, str]) -> None:
    backend, path, out = args
    (_naive_vips if backend == "vips" else _naive_pillow)(path, out)


def _warm(_: int) -> None:
    import pyvips  # noqa: F401  # both libraries loaded before the clock starts
    from PIL import Image  # noqa: F401


def children_cpu() -> float:
    """CPU seconds (user + system) of every waited-for descendant so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_naive(backend: str, paths: list[Path], workers: int, work: Path, concurrency: int
              ) -> tuple[float, float]:  # fmt: skip
    """(wall seconds of the map, CPU seconds of the pool's processes, start-up included).
    `concurrency` 0 leaves libvips at its default (one thread per core)."""
    out = work / f"naive-{backend}"
    out.mkdir(exist_ok=True)
    tasks = [(backend, str(p), str(out / p.stem)) for p in paths]
    ctx = multiprocessing.get_context("fork")
    saved = os.environ.pop("VIPS_CONCURRENCY", None)
    if concurrency:
        os.environ["VIPS_CONCURRENCY"] = str(concurrency)  # read when the child loads libvips
    cpu = children_cpu()
    try:
        with ctx.Pool(workers) as pool:
            pool.map(_warm, range(workers))
            started = time.perf_counter()
            pool.map(_naive_task, tasks, chunksize=1)
            wall = time.perf_counter() - started
            pool.close()
            pool.join()
    finally:
        os.environ.pop("VIPS_CONCURRENCY", None)
        if saved is not None:
            os.environ["VIPS_CONCURRENCY"] = saved
    return wall, children_cpu() - cpu


# --- derivd -------------------------------------------------------------------------------


def run_derivd(pg: object, backend: str, paths: list[Path], workers: int, work: Path,
               concurrency: int, tag: str = "") -> tuple[float, float]:  # fmt: skip
    """(first claim to last finish from the rows, CPU seconds of derivd's processes:
    supervisor and workers, boot included; PostgreSQL's own CPU is not counted)."""
    dsn = fresh_db(pg, f"e2e_{backend}{tag}")  # type: ignore[arg-type]
    store = work / f"objects-{backend}{tag}"
    store_and_queue(dsn, store, [(f"originals/{path.stem}", path) for path in paths])
    ini = work / f"derivd-{backend}.ini"
    ini.write_text(
        f"[database]\ndsn = {dsn}\n[storage]\nbackend = fs\nroot = {store}\n"
        f"[supervisor]\nworkers = {workers}\nstate_dir = {work / 'state'}\n"
        f"[derive]\nbackend = {backend}\nquality = {QUALITY}\neffort = {EFFORT}\n"
        f"concurrency = {concurrency}\n"
        f"variants = {', '.join(f'{n}:{e}' for n, e in VARIANTS)}\n",
        encoding="utf-8",
    )
    burst = burst_drain(ini, work / f"derivd-{backend}.log", dsn)
    if burst.ready != len(paths):
        raise SystemExit(f"derivd ({backend}) left {len(paths) - burst.ready} images unfinished")
    return burst.drain_s, burst.cpu_s


def load() -> float:
    return os.getloadavg()[0]


def one_round(pg: object, backend: str, paths: list[Path], args: argparse.Namespace,
              work: Path, index: int) -> dict[str, object]:  # fmt: skip
    """Both sides once; odd rounds run derivd first, so neither always gets the quieter
    minutes of a shared machine."""
    sides: dict[str, tuple[float, float]] = {}
    loads = [load()]
    order = ("naive", "derivd") if index % 2 == 0 else ("derivd", "naive")
    for side in order:
        print(f"{backend} round {index + 1}: {side} ...", file=sys.stderr, flush=True)
        if side == "naive":
            sides[side] = run_naive(backend, paths, args.workers, work, args.naive_concurrency)
        else:
            sides[side] = run_derivd(pg, backend, paths, args.workers, work, args.concurrency,
                                     tag=f"_{index}")  # fmt: skip
        loads.append(load())
    (ours, ours_cpu), (naive, naive_cpu) = sides["derivd"], sides["naive"]
    n = len(paths)
    return {"backend": backend, "round": index + 1, "order": list(order), "images": n,
            "derivd_s": ours, "naive_s": naive, "derivd_cpu_s": ours_cpu,
            "naive_cpu_s": naive_cpu, "derivd_images_per_s": n / ours,
            "naive_images_per_s": n / naive, "speedup": naive / ours,
            "cpu_speedup": naive_cpu / ours_cpu, "load_1min": loads}  # fmt: skip


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The median round of each backend by wall ratio, and the medians of both ratios."""
    by_wall = sorted(rounds, key=lambda r: r["speedup"])
    return {**by_wall[len(by_wall) // 2],
            "speedup_median": statistics.median(r["speedup"] for r in rounds),
            "cpu_speedup_median": statistics.median(r["cpu_speedup"] for r in rounds),
            "rounds": len(rounds)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=24)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="derivd's [derive] concurrency (libvips threads per worker)",
    )
    parser.add_argument(
        "--naive-concurrency",
        type=int,
        default=0,
        help="libvips threads per naive process; 0: libvips' default",
    )
    parser.add_argument("--backends", nargs="+", default=["vips", "pillow"])
    parser.add_argument("--inputs", type=Path, default=ROOT / "bench" / "out" / "e2e-inputs")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "e2e.json")
    args = parser.parse_args()
    print("generating inputs ...", file=sys.stderr, flush=True)
    paths = make_inputs(args.inputs, args.images)
    megapixels = sum(int(p.stem.split("-")[1].split("x")[0]) * int(p.stem.split("x")[1])
                     for p in paths) / 1e6  # fmt: skip
    rounds: list[dict[str, Any]] = []
    with cluster() as pg, tempfile.TemporaryDirectory(prefix="derivd-e2e-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        for backend in args.backends:
            for index in range(args.rounds):
                rounds.append(one_round(pg, backend, paths, args, work, index))
        lines = machine(pg.dsn())
    naive_threads = args.naive_concurrency or os.cpu_count()
    lines.append(
        f"{len(paths)} images, {megapixels:.0f} MP in all, {args.workers} workers / "
        f"processes, variants {VARIANTS}, WebP q{QUALITY} effort {EFFORT}"
    )
    lines.append(f"libvips threads per process: derivd {args.concurrency}, naive {naive_threads}")
    print("\n".join(lines))
    print(table(
        ["backend", "round", "derivd s", "naive s", "derivd img/s", "naive img/s",
         "derivd / naive", "derivd cpu s", "naive cpu s", "by cpu", "load"],
        [[r["backend"], r["round"], r["derivd_s"], r["naive_s"], r["derivd_images_per_s"],
          r["naive_images_per_s"], f"{r['speedup']:.2f}x", r["derivd_cpu_s"],
          r["naive_cpu_s"], f"{r['cpu_speedup']:.2f}x",
          "-".join(f"{x:.1f}" for x in r["load_1min"])] for r in rounds],
    ))  # fmt: skip
    results = [summary([r for r in rounds if r["backend"] == b]) for b in args.backends]
    for r in results:
        print(f"{r['backend']}: median of {r['rounds']} rounds: {r['speedup_median']:.2f}x "
              f"images/s (wall), {r['cpu_speedup_median']:.2f}x by CPU")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bench": "e2e", "machine": lines, "results": results,
                                    "rounds": rounds, "concurrency": args.concurrency,
                                    "naive_concurrency": naive_threads},
                                   indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
