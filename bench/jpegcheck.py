"""What the JPEG damage check costs (handlers/jpegcheck.py), per path a JPEG takes.

    .venv/bin/python bench/jpegcheck.py [--repeat N] [--backends vips pillow]

A JPEG the fast decode takes pays nothing: that decode was strict already. One it does
not take (CMYK on `vips`, over its 64 MiB bound, `shrink_on_load = off`) pays one more
strict libjpeg-turbo decode at 1/8 scale before the backend's own decoder. For each
path: the median CPU ms of one derive (all variants) and of `check_jpeg` alone on the
same file (part of the derive only where the fast decode declines the file), over N runs
after a warm-up, in one process per backend (libvips at concurrency 1, as a worker). The
photos are imagegen's scene with seeded grain, so the entropy decode has detail to work
through. To compare with a commit before the check, check out that commit's handlers/
and run this again: the derive column is comparable.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]

# (label, file, long edges of the variants, shrink_on_load)
CASES = (
    ("24 MP -> 1600, 320 (fast decode)", "24MP.jpg", (1600, 320), "fast"),
    ("12 MP CMYK -> 1600, 320", "12MP-cmyk.jpg", (1600, 320), "fast"),
    ("48 MP -> 4000 (over the bound)", "48MP.jpg", (4000,), "fast"),
    ("24 MP -> 1600, 320, off", "24MP.jpg", (1600, 320), "off"),
)


def make_inputs(directory: Path) -> None:
    import imagegen
    from PIL import Image

    def photo(width: int, height: int) -> Image.Image:
        noise = random.Random(1).randbytes(width * height)
        grain = Image.frombytes("L", (width, height), noise).convert("RGB")
        return Image.blend(imagegen.scene(width, height), grain, 0.1)

    twenty_four = photo(6000, 4000)
    twenty_four.save(directory / "24MP.jpg", quality=90)
    twenty_four.resize((4240, 2832)).convert("CMYK").save(directory / "12MP-cmyk.jpg", quality=90)
    photo(8000, 6000).save(directory / "48MP.jpg", quality=90)


def median_ms(run: Callable[[], object], repeat: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.process_time()
        run()
        times.append(time.process_time() - start)
    return statistics.median(times) * 1000


def child(backend: str, directory: Path, repeat: int) -> None:
    from derivd.handlers.base import DeriveSpec, VariantSpec
    from derivd.handlers.registry import create_handler

    try:
        from derivd.handlers.jpegcheck import check_jpeg
    except ImportError:  # a commit before the check
        check_jpeg = None
    for label, name, edges, mode in CASES:
        data = (directory / name).read_bytes()
        variants = tuple(VariantSpec(f"v{edge}", edge) for edge in edges)
        spec = DeriveSpec(variants=variants, concurrency=1, shrink_on_load=mode)
        handler = create_handler(backend, spec)
        derive = median_ms(lambda: handler.derive(data, spec), repeat)  # noqa: B023
        check = "-"
        if check_jpeg is not None:
            check = f"{median_ms(lambda: check_jpeg(data), repeat):.0f}"  # noqa: B023
        print(f"{label:36} {backend:7} {derive:9.0f} {check:>9}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--backends", nargs="+", default=["vips", "pillow"])
    parser.add_argument("--child", nargs=2, metavar=("BACKEND", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]), args.repeat)
        return
    print(f"median CPU ms of {args.repeat} runs after a warm-up")
    print(f"{'input -> variants':36} {'backend':7} {'derive':>9} {'check':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        make_inputs(Path(tmp))
        for backend in args.backends:
            command = [sys.executable, __file__, "--child", backend, tmp, "--repeat",
                       str(args.repeat)]  # fmt: skip
            subprocess.run(command, check=True, env={**os.environ, "VIPS_CONCURRENCY": "1"})


if __name__ == "__main__":
    main()
