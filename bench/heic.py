"""Phone photos (HEIC) through both handlers: time, peak RSS, and what the analysis costs.

    .venv/bin/python bench/heic.py [--repeat N] [--out bench/out/heic.json]

Inputs: the phone photos of tests/corpus/heic (12 MP iPhone HEICs: a 48-tile grid with a
Display P3 profile, depth map and gain map; one turned to portrait by `irot`). Variants:
a 1600 px preview and a 320 px thumbnail, WebP, as in the handler tests.

Each cell runs in a fresh subprocess (as bench/derive.py): the median CPU time
(process_time, every thread) and wall time of one `derive` over N runs after a warm-up,
and the subprocess' peak RSS (VmHWM). Two runs per cell: with the analysis (as shipped)
and without it (the backend's `analysis_of` replaced by a no-op), and inside the first the
analysis step itself is timed (`small_copy` + `analyse`): on a loaded machine the
difference of two medians is noise-bound, the step's own time is not.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

PHOTOS = ("pug.heic", "arrow.heic")
CORPUS = ROOT / "tests" / "corpus" / "heic"


def child(backend: str, path: str, repeat: int, analysis: bool) -> None:
    from derivd.handlers.base import DeriveSpec, VariantSpec
    from derivd.handlers.registry import create_handler

    spec = DeriveSpec(
        variants=(VariantSpec("preview", 1600), VariantSpec("thumb", 320)), concurrency=1
    )
    handler = create_handler(backend, spec)
    module = importlib.import_module(f"derivd.handlers.{backend}")
    real = module.analysis_of
    spent: list[float] = []

    def timed(*args: Any) -> Any:
        start = time.process_time()
        result = real(*args)
        spent.append(time.process_time() - start)
        return result

    module.analysis_of = timed if analysis else (lambda *args: None)
    data = Path(path).read_bytes()
    handler.derive(data, spec)  # warm-up
    spent.clear()
    times, cpu = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        handler.derive(data, spec)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    print(json.dumps({
        "cpu_s": statistics.median(cpu), "wall_s": statistics.median(times),
        "analysis_s": statistics.median(spent) if spent else 0.0, "peak_kib": _vm_hwm_kib(),
    }))  # fmt: skip


def _vm_hwm_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure(backend: str, path: Path, repeat: int, analysis: bool) -> dict[str, float]:
    env = {**os.environ, "VIPS_CONCURRENCY": "1"}
    cmd = [sys.executable, __file__, "--child", backend, str(path), "--repeat", str(repeat)]
    if not analysis:
        cmd.append("--no-analysis")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{backend} on {path.name} failed ({proc.returncode})")
    result: dict[str, float] = json.loads(proc.stdout)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "heic.json")
    parser.add_argument("--child", nargs=2, metavar=("BACKEND", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--no-analysis", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.repeat, not args.no_analysis)
        return
    import pi_heif
    from common import table

    print(f"cpus={os.cpu_count()} load={os.getloadavg()[0]:.1f} pi-heif={pi_heif.__version__} "
          f"libheif={pi_heif.libheif_version()} median of {args.repeat}")  # fmt: skip
    rows, records = [], []
    for name in PHOTOS:
        for backend in ("vips", "pillow"):
            on = measure(backend, CORPUS / name, args.repeat, analysis=True)
            off = measure(backend, CORPUS / name, args.repeat, analysis=False)
            step = on["analysis_s"] / on["cpu_s"] * 100
            delta = (on["cpu_s"] - off["cpu_s"]) / off["cpu_s"] * 100
            rows.append([name, backend, on["cpu_s"] * 1000, on["wall_s"] * 1000,
                         on["peak_kib"] / 1024, off["cpu_s"] * 1000, on["analysis_s"] * 1000,
                         f"{step:.2f} %", f"{delta:+.1f} %"])  # fmt: skip
            records.append({"photo": name, "backend": backend, "with": on, "without": off})
    print(table(["photo", "backend", "cpu ms", "wall ms", "peak MiB", "cpu ms w/o analysis",
                 "analysis ms", "analysis share", "with - without"], rows))  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bench": "heic", "rows": records}, indent=2) + "\n")


if __name__ == "__main__":
    main()
