"""derivd against sharp, on sharp's own benchmark task and on phone photos.

    .venv/bin/python bench/sharp.py [--images 240] [--sets sharp phone]
        [--backends vips pillow] [--workers N] [--rounds 1] [--fixture PATH]
        [--baseline REF] [--build REF ...] [--label LABEL]

sharp's published benchmark (test/bench/perf.js in lovell/sharp) resizes its 2725 x 2225
JPEG fixture to 720 x 588 (sharp's default fit: cover, centred) and writes JPEG quality 80.
Here both sides do that task on `--images` copies of the fixture, and on as many 12 MP
phone-sized JPEGs (4032 x 3024, a third of them portraits stored sideways with EXIF
orientation 6; photo-like scenes with grain from tests/support/imagegen.py, cached in bench/out/):

- sharp: sharp SHARP_VERSION from npm, installed into bench/.sharp/ (git-ignored), run by
  bench/sharp_task.js in a fresh node process per run, both of sharp's ways to use the
  cores: `per-core` (one libvips thread per image, one image per core in flight) and
  `one-image` (every core on one image at a time); the better one is its figure.
- derivd, whole: the originals stored in the fs store and queued (not timed), then one
  `derivd run --burst` with one worker per core and `[variant:bench] size = 720x588,
  fit = cover, format = jpeg, quality = 80`: boot, queue, store (fsync), fenced commits.
  With `--baseline REF`, the same again with REF's handlers (the rest this tree), right
  after: a change to the pixels against the commit before it, in the same minutes. With
  `--build REF` (repeatable), the same again with REF's whole build (side
  `derivd:BACKEND#REF`): a change to the boot, the worker or the queue, likewise.
- floor, per backend right after derivd's run: the plain-library pipeline at derivd's
  decode scale (bench/steps.py `--floor`: libjpeg-turbo at M/8, lanczos3 at the exact
  scale, the centre cut, the same JPEG save; no queue, limits, colour checks or
  analysis), one process per core: what derivd's pixel work costs with nothing around
  it. "vs floor" is derivd's images/s over that round's floor of its backend.

sharp and derivd are each timed as a whole process (start to exit); CPU and peak RSS are
the kernel's accounting of the process and its children (wait4): PostgreSQL's own CPU is
not counted. The floor times its work alone: its lanes import first, then start together
(wall from then to the last lane's end, CPU and peak RSS each lane's own, `run_floor`).
Fidelity, the lowest over the distinct inputs: SSIM (tests/support/fidelity.py) of each derivd
output against sharp's output for the same input, and of the backend's variant against its
own full decode (the handler with `shrink_on_load = off`: no shrink-on-load at all, the
same resize; both written as PNG, so the JPEG encoder's loss does not count twice).
Prints a table with the load average beside each run (the machine may be shared: quote CPU
per image over images/s when the load is high), writes bench/out/sharp.json
(bench/plots.py draws chart-sharp.png from it).

When `node`/`npm` are missing the sharp side is skipped (one line says so) and derivd's
figures are still measured. The fixture is a Flickr photograph (grizdave, 2569067123)
whose licence sharp's repository does not state, so it is never committed: it is
downloaded into bench/.sharp/ on first use (checked against its SHA-256), or taken from
`--fixture PATH`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import psycopg
from common import (
    DERIVD,
    ROOT,
    Burst,
    Measured,
    built,
    burst_drain,
    cluster,
    fresh_db,
    machine,
    measured,
    save_results,
    store_and_queue,
    table,
)

sys.path.insert(0, str(ROOT / "tests" / "support"))
from fidelity import ssim

from derivd.storage.fs import FsStorage

SHARP_VERSION = "0.34.5"
HOME = ROOT / "bench" / ".sharp"  # git-ignored: node_modules, the fixture
TASK = ROOT / "bench" / "sharp_task.js"
FIXTURE_NAME = "2569067123_aca715a2ee_o.jpg"
FIXTURE_URL = f"https://raw.githubusercontent.com/lovell/sharp/main/test/fixtures/{FIXTURE_NAME}"
FIXTURE_SHA256 = "0de3824939c164c81b2742b83b51a0f621ed1142b57ef8ad3f33a5a2c2634dd0"
BOX, QUALITY = (720, 588), 80
PHONE = (4032, 3024)
PHONE_DISTINCT = 12  # distinct phone photos, cycled to --images
SHARP_MODES = ("per-core", "one-image")


@dataclass
class Run:
    """One side's run over one set of images."""

    set: str
    side: str  # sharp:per-core, sharp:one-image, derivd:vips, derivd:pillow
    images: int
    wall_s: float
    cpu_s: float
    peak_rss_mb: float
    load_1min: float
    ssim_vs_sharp_min: float | None = None
    ssim_vs_full_min: float | None = None
    round: int = 0

    @property
    def images_per_s(self) -> float:
        return self.images / self.wall_s

    @property
    def cpu_ms_per_image(self) -> float:
        return self.cpu_s / self.images * 1000


# --- inputs -------------------------------------------------------------------------------


def sharp_fixture(given: Path | None) -> Path | None:
    """sharp's fixture in bench/.sharp/: from `given`, else downloaded once."""
    path = HOME / FIXTURE_NAME
    if given is not None:
        HOME.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(given, path)
    elif not path.exists():
        try:
            with urllib.request.urlopen(FIXTURE_URL, timeout=30) as response:
                data = response.read()
        except OSError as error:
            print(f"sharp set: skipped (cannot download the fixture: {error}; "
                  "pass --fixture PATH)")  # fmt: skip
            return None
        HOME.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    if hashlib.sha256(path.read_bytes()).hexdigest() != FIXTURE_SHA256:
        print(f"sharp set: skipped ({path} is not sharp's fixture: SHA-256 differs)")
        return None
    return path


def phone_photos(folder: Path) -> list[Path]:
    """12 MP photo-like JPEGs (q90, 4:2:0 as phones write); every third is a portrait
    stored sideways with EXIF orientation 6, as phones store them. Cached in `folder`."""
    import imagegen
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for n in range(PHONE_DISTINCT):
        portrait = n % 3 == 2
        path = folder / f"phone-{n:02d}{'-portrait' if portrait else ''}.jpg"
        paths.append(path)
        if path.exists():
            continue
        width, height = PHONE
        rng = random.Random(n)
        scene = imagegen.scene(*((height, width) if portrait else (width, height)))
        grain = Image.effect_noise(scene.size, 12 + rng.randrange(16)).convert("RGB")
        photo = Image.blend(scene, grain, 0.2)
        exif = Image.Exif()
        if portrait:  # stored landscape; orientation 6 turns it upright
            photo = photo.transpose(Image.Transpose.ROTATE_90)
            exif[0x0112] = 6
        photo.save(path, "JPEG", quality=90, exif=exif.tobytes())
    return paths


# --- sharp --------------------------------------------------------------------------------


def install_sharp() -> bool:
    """sharp SHARP_VERSION in bench/.sharp/node_modules; False (one line) without node."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        print("sharp: skipped (node or npm not found)")
        return False
    package = HOME / "node_modules" / "sharp" / "package.json"
    if package.exists() and json.loads(package.read_text())["version"] == SHARP_VERSION:
        return True
    HOME.mkdir(parents=True, exist_ok=True)
    (HOME / "package.json").write_text('{"private": true}\n')
    print(f"installing sharp {SHARP_VERSION} into {HOME.relative_to(ROOT)} ...", file=sys.stderr)
    subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(HOME),
                    f"sharp@{SHARP_VERSION}"], check=True, capture_output=True)  # fmt: skip
    return True


def run_sharp(mode: str, inputs: list[Path], workers: int, out: Path) -> Measured:
    """sharp_task.js over `inputs`; its outputs land in `out` as NNNN-<stem>.jpg."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = dict(os.environ, NODE_PATH=str(HOME / "node_modules"))
    argv = ["node", str(TASK), mode, str(workers), str(BOX[0]), str(BOX[1]), str(QUALITY),
            str(out), *map(str, inputs)]  # fmt: skip
    return measured(argv, out.with_suffix(".log"), env)


# --- the floor ----------------------------------------------------------------------------


def run_floor(backend: str, inputs: list[Path], workers: int, out: Path) -> Measured:
    """The plain-library floor at derivd's decode scale (bench/steps.py `--floor`:
    libjpeg-turbo at M/8, the backend's lanczos3 at the exact scale, the centre cut, the
    same JPEG save; nothing else), one process per core over the same inputs, in the same
    minutes as derivd's run: the most any program doing derivd's pixel work with these
    libraries reaches here. Unlike the other sides only the work is timed: each lane
    imports first (bench/steps.py's own imports, psycopg and derivd among them, and the
    libraries: ~0.5 CPU s a lane, ~8 ms an image at 120 images while it was timed),
    then all start together."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    result = out.with_suffix(".json")
    argv = [sys.executable, str(ROOT / "bench" / "steps.py"), "--floor", backend, "--lanes",
            str(workers), "--out", str(out), "--result", str(result),
            *map(str, inputs)]  # fmt: skip
    with out.with_suffix(".log").open("w") as log:
        subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                       check=True)  # fmt: skip
    timing = json.loads(result.read_text())
    return Measured(timing["wall_s"], timing["cpu_s"], timing["peak_rss_mb"])


# --- derivd -------------------------------------------------------------------------------


def baseline_tree(ref: str, work: Path) -> dict[str, str]:
    """The environment of a derivd that is this tree but for its handlers, which are
    `ref`'s: `--baseline`, the pixels before a change measured beside them in one run
    (the rest of derivd moves on meanwhile, so only the handlers are swapped)."""
    import derivd

    tree = work / "baseline"
    shutil.copytree(Path(derivd.__file__).parent, tree / "derivd", symlinks=False,
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    shutil.rmtree(tree / "derivd" / "handlers")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "handlers"],
                             check=True, capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(tree / "derivd")], input=archive, check=True)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree)], check=True)
    return dict(os.environ, PYTHONPATH=str(tree))


def queued_task(dsn: str, store: Path, inputs: list[Path], backend: str, workers: int,
                ini: Path, *, migrate_with: Path | None = None) -> Path:  # fmt: skip
    """`inputs` stored in the fs store at `store` and queued in `dsn` (not timed), and
    `ini`, the configuration of a `run --burst` doing sharp's task on them: what every
    derivd run of this benchmark (and bench/anatomy.py) drains. `migrate_with`: the
    `derivd` of another build, which migrates `dsn` to its own schema first (an older
    build refuses a database migrated past it)."""
    ini.write_text(
        f"[database]\ndsn = {dsn}\n[storage]\nbackend = fs\nroot = {store}\n"
        f"[supervisor]\nworkers = {workers}\nstate_dir = {ini.parent / 'state'}\n"
        f"[derive]\nbackend = {backend}\nvariants = bench\n"
        f"[variant:bench]\nsize = {BOX[0]}x{BOX[1]}\nfit = cover\nformat = jpeg\n"
        f"quality = {QUALITY}\n",
        encoding="utf-8",
    )
    if migrate_with is not None:
        subprocess.run([str(migrate_with), "-c", str(ini), "migrate"], check=True,
                       capture_output=True)  # fmt: skip
    store_and_queue(dsn, store, [(f"originals/{n:04d}", path) for n, path in enumerate(inputs)])
    return ini


def run_derivd(pg: Any, backend: str, inputs: list[Path], workers: int, work: Path,
               tag: str, env: dict[str, str] | None = None, derivd: Path = DERIVD
               ) -> tuple[Burst, list[bytes]]:  # fmt: skip
    """Store and queue `inputs` (not timed), then one `run --burst` (in `env`: a
    `--baseline`; `derivd`: a `--build`'s). Returns the run and each input's output
    bytes, in input order."""
    other_build = derivd != DERIVD  # it migrates its own database
    dsn = fresh_db(pg, f"sharp_{tag}", derivd_schema=not other_build)
    store = work / f"objects-{tag}"
    ini = queued_task(dsn, store, inputs, backend, workers, work / f"derivd-{tag}.ini",
                      migrate_with=derivd if other_build else None)  # fmt: skip
    burst = burst_drain(ini, work / f"derivd-{tag}.log", dsn, env, derivd)
    if burst.ready != len(inputs):
        raise SystemExit(f"derivd ({tag}) left {len(inputs) - burst.ready} images unfinished")
    with psycopg.connect(dsn) as conn:
        found = conn.execute(
            "SELECT f.original_key, v.key, v.version FROM archive_variants v"
            "  JOIN archive_files f ON f.id = v.file_id"
        ).fetchall()
    storage = FsStorage(store)
    by_key = {original: storage.path_of(key, version).read_bytes()
              for original, key, version in found}  # fmt: skip
    return burst, [by_key[f"originals/{n:04d}"] for n in range(len(inputs))]


def decode_fidelity(backend: str, data: bytes) -> float | None:
    """SSIM of the backend's variant as derived (`[derive] shrink_on_load = fast`, the
    default) against its full decode (`off`), both written lossless (PNG): what the
    decoding costs, without counting the JPEG encoder's own loss twice."""
    from derivd.handlers.base import DeriveSpec, VariantSpec
    from derivd.handlers.registry import create_handler

    if "shrink_on_load" not in DeriveSpec.__dataclass_fields__:
        return None  # a derivd from before the setting (a before/after comparison)
    variant = VariantSpec("bench", box=BOX, fit="cover", formats=("png",))
    made = []
    for mode in ("fast", "off"):
        spec = replace(DeriveSpec(variants=(variant,), concurrency=1), shrink_on_load=mode)
        (out,) = create_handler(backend, spec).derive(data, spec)
        made.append(bytes(out.data))
    return ssim(made[1], made[0])


# --- one set ------------------------------------------------------------------------------


def one_set(pg: Any, name: str, distinct: list[Path], args: argparse.Namespace, work: Path,
            with_sharp: bool, rnd: int) -> list[Run]:  # fmt: skip
    """One round over one set: sharp's two ways and derivd per backend, sharp first in
    even rounds and last in odd ones (neither side always gets the quieter minutes)."""
    inputs = [distinct[n % len(distinct)] for n in range(args.images)]
    runs: list[Run] = []
    sharp_out: dict[int, bytes] = {}
    derivd_out: dict[str, list[bytes]] = {}
    for side in ("sharp", "derivd") if rnd % 2 == 0 else ("derivd", "sharp"):
        if side == "sharp" and with_sharp:
            for mode in SHARP_MODES:
                print(f"{name}: sharp {mode} ...", file=sys.stderr, flush=True)
                out = work / f"sharp-{name}-{mode}"
                wall, cpu, rss = run_sharp(mode, inputs, args.workers, out)
                runs.append(Run(name, f"sharp:{mode}", len(inputs), wall, cpu, rss,
                                os.getloadavg()[0], round=rnd))  # fmt: skip
            for path in sorted(out.iterdir()):
                sharp_out[int(path.name[:4])] = path.read_bytes()
        if side == "derivd":
            for backend in args.backends:
                print(f"{name}: derivd {backend} ...", file=sys.stderr, flush=True)
                burst, derivd_out[backend] = run_derivd(pg, backend, inputs, args.workers, work,
                                                        f"{name}_{backend}_{rnd}")  # fmt: skip
                runs.append(Run(name, f"derivd:{backend}", len(inputs), burst.wall_s,
                                burst.cpu_s, burst.peak_rss_mb, os.getloadavg()[0],
                                round=rnd))  # fmt: skip
                if args.baseline:
                    print(f"{name}: derivd {backend} at {args.baseline} ...", file=sys.stderr,
                          flush=True)  # fmt: skip
                    tag = f"{name}_{backend}_{rnd}_base"
                    burst, _ = run_derivd(pg, backend, inputs, args.workers, work, tag,
                                          args.baseline_env)  # fmt: skip
                    runs.append(Run(name, f"derivd:{backend}@{args.baseline}", len(inputs),
                                    burst.wall_s, burst.cpu_s, burst.peak_rss_mb,
                                    os.getloadavg()[0], round=rnd))  # fmt: skip
                for ref, derivd in args.build_commands.items():
                    print(f"{name}: derivd {backend} as built at {ref} ...", file=sys.stderr,
                          flush=True)  # fmt: skip
                    commit = derivd.parents[2].name  # bench/.builds/<commit>/.venv/bin/derivd
                    tag = f"{name}_{backend}_{rnd}_{commit}"  # a database name: not the ref
                    burst, _ = run_derivd(pg, backend, inputs, args.workers, work, tag,
                                          derivd=derivd)  # fmt: skip
                    runs.append(Run(name, f"derivd:{backend}#{ref}", len(inputs), burst.wall_s,
                                    burst.cpu_s, burst.peak_rss_mb, os.getloadavg()[0],
                                    round=rnd))  # fmt: skip
                print(f"{name}: floor {backend} ...", file=sys.stderr, flush=True)
                wall, cpu, rss = run_floor(backend, inputs, args.workers, work / "floor")
                runs.append(Run(name, f"floor:{backend}", len(inputs), wall, cpu, rss,
                                os.getloadavg()[0], round=rnd))  # fmt: skip
    # Fidelity once per distinct input (the copies are the same bytes).
    firsts = {distinct.index(path): n for n, path in reversed(list(enumerate(inputs)))}
    for run in runs:
        backend = run.side.removeprefix("derivd:")
        if backend not in derivd_out:
            continue
        outputs = derivd_out[backend]
        if sharp_out:
            run.ssim_vs_sharp_min = min(ssim(sharp_out[n], outputs[n]) for n in firsts.values())
        fidelity = [decode_fidelity(backend, path.read_bytes()) for path in distinct]
        run.ssim_vs_full_min = None if None in fidelity else min(filter(None, fidelity))
    return runs


def best_sharp(runs: list[Run], name: str, rnd: int) -> Run | None:
    """sharp's better way on this set in this round: the reference derivd's runs of the
    same round are held to (runs minutes apart on a shared machine do not compare)."""
    sharp = [r for r in runs if r.set == name and r.round == rnd and r.side.startswith("sharp:")]
    return max(sharp, key=lambda r: r.images_per_s) if sharp else None


def ratio_to_sharp(runs: list[Run], run: Run) -> float | None:
    sharp = best_sharp(runs, run.set, run.round)
    return run.images_per_s / sharp.images_per_s if sharp else None


def ratio_to_floor(runs: list[Run], run: Run) -> float | None:
    """A derivd run's images/s over the same round's floor of its backend."""
    if not run.side.startswith("derivd:"):
        return None
    floor = run.side.replace("derivd:", "floor:")
    same = [r for r in runs if (r.set, r.round, r.side) == (run.set, run.round, floor)]
    return run.images_per_s / same[0].images_per_s if same else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=240)
    parser.add_argument("--sets", nargs="+", default=["sharp", "phone"], choices=["sharp", "phone"])
    parser.add_argument("--backends", nargs="+", default=["vips", "pillow"])
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="derivd workers and sharp's cores (default: one per core)",
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--fixture", type=Path, help=f"a local copy of sharp's {FIXTURE_NAME}")
    parser.add_argument("--label", default="", help="written as bench/out/sharp-LABEL.json")
    parser.add_argument("--baseline", help="also derivd with the handlers of this git ref")
    parser.add_argument(
        "--build",
        action="append",
        default=[],
        metavar="REF",
        help="also derivd whole as REF builds it (its own tree and venv, bench/common.built), "
        "in the same rounds: a change outside the handlers (boot, worker, queue) against the "
        "commit before it; repeatable",
    )
    args = parser.parse_args()
    args.build_commands = {ref: built(ref) for ref in args.build}
    with_sharp = install_sharp()
    sets: dict[str, list[Path]] = {}
    if "sharp" in args.sets and (fixture := sharp_fixture(args.fixture)) is not None:
        sets["sharp"] = [fixture]
    if "phone" in args.sets:
        print("generating phone photos ...", file=sys.stderr, flush=True)
        sets["phone"] = phone_photos(ROOT / "bench" / "out" / "sharp-inputs")
    runs: list[Run] = []
    with cluster() as pg, tempfile.TemporaryDirectory(prefix="derivd-sharp-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        args.baseline_env = baseline_tree(args.baseline, work) if args.baseline else None
        for rnd in range(args.rounds):
            for name, distinct in sets.items():
                runs += one_set(pg, name, distinct, args, work, with_sharp, rnd)
        lines = machine(pg.dsn())
    lines.append(f"sharp {SHARP_VERSION if with_sharp else '(skipped)'}; {args.workers} cores "
                 f"for each side; {args.images} images per set; {BOX[0]}x{BOX[1]} cover, "
                 f"JPEG q{QUALITY}")  # fmt: skip
    print("\n".join(lines))
    rows = []
    for r in runs:
        ratio, to_floor = ratio_to_sharp(runs, r), ratio_to_floor(runs, r)
        rows.append([r.set, r.round + 1, r.side, r.images_per_s,
                     "-" if ratio is None else f"{ratio:.2f}x",
                     "-" if to_floor is None else f"{to_floor:.2f}x", r.cpu_ms_per_image,
                     r.peak_rss_mb,
                     "-" if r.ssim_vs_sharp_min is None else f"{r.ssim_vs_sharp_min:.3f}",
                     "-" if r.ssim_vs_full_min is None else f"{r.ssim_vs_full_min:.3f}",
                     r.load_1min])  # fmt: skip
    print(table(["set", "round", "side", "images/s", "vs sharp's best", "vs floor", "CPU ms/image",
                 "peak RSS MiB", "SSIM vs sharp (min)", "SSIM vs full decode (min)", "load"],
                rows))  # fmt: skip
    for name in sets:
        for side in sorted({r.side for r in runs if r.set == name}):
            mine = [r for r in runs if r.set == name and r.side == side]
            ratios = [x for r in mine if (x := ratio_to_sharp(runs, r)) is not None]
            floors = [x for r in mine if (x := ratio_to_floor(runs, r)) is not None]
            cpu = statistics.median(r.cpu_ms_per_image for r in mine)
            vs = f"{statistics.median(ratios):.2f}x sharp's best" if ratios else "-"
            of_floor = f", {statistics.median(floors):.2f}x its floor" if floors else ""
            print(f"{name} {side}: median of {len(mine)} rounds: {vs} "
                  f"({min(ratios, default=0):.2f}-{max(ratios, default=0):.2f}){of_floor}, "
                  f"{cpu:.1f} CPU ms/image")  # fmt: skip
    path = save_results(f"sharp-{args.label}" if args.label else "sharp", {
        "machine": lines, "sharp_version": SHARP_VERSION if with_sharp else None,
        "label": args.label,
        "runs": [asdict(r) | {"images_per_s": r.images_per_s,
                              "cpu_ms_per_image": r.cpu_ms_per_image,
                              "vs_sharp": ratio_to_sharp(runs, r),
                              "vs_floor": ratio_to_floor(runs, r)} for r in runs],
    })  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
