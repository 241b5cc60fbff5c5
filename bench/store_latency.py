"""A far object store against a near one: `derivd run --burst` on the file store, on S3
over loopback (moto's server) and on S3 40 ms away (the same server behind a latency
proxy, 20 ms each way), with one worker per core and three per core, pipeline 1 and 2.

    .venv/bin/python bench/store_latency.py [--images 48] [--rounds 2] [--delay-ms 20]
        [--workers N M] [--pipelines 1 2] [--backend vips] [--refs main]

The images are the six 12 MP phone JPEGs of bench/sharp.py, cycled to `--images` jobs,
with the default variants. Every run gets a fresh database on one embedded PostgreSQL
(fsync on) and its originals stored (untimed) in the store under test. Each round runs
every combination once, in an order reversed on odd rounds (interleaved: the neighbours'
load falls on every side alike); the table shows each combination's median round.
`--refs`: other commits' builds (bench/.builds, each migrating its own databases) run
every combination too, interleaved with this build's in every round.

- images/s: ready rows / (first claim to last finish, database clock);
- CPU/image: user + system CPU of the supervisor and its workers per image (boot
  included; PostgreSQL's, moto's and the proxy's not);
- peak RSS: the largest process of the run, a worker (getrusage of the waited children);
- vs fs: images/s over the file store's at the same workers and pipeline, same round;
- moto, proxy: the CPU of the S3 server and of the latency proxy (this process's own
  threads) per image during the run: the rig's cost, which the file store does not pay;
- idle: the machine's idle CPU over the run, % of cores x its wall time (boot included);
- rig bound: the file store's images/s scaled by its busy core time per image over that
  plus moto's and the proxy's CPU per image: what this many cores allow when the derive
  work is the file store's and the rig's CPU comes on top (same round);
- between derives: a pipelined worker's deriving thread waiting for an original or for
  a place, between its first derive and its last, % of that span (event `pipeline
  time`; a build without it, and pipeline 1, show "-").

Writes bench/out/store_latency.json (bench/plots.py draws chart-store_latency.png).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psycopg
from common import (
    DERIVD,
    ROOT,
    built,
    burst_drain,
    cluster,
    fresh_db,
    git,
    machine,
    save_results,
    store_and_queue,
    table,
)
from latency_proxy import LatencyProxy

STORES = ("fs", "s3", "s3+40ms")
REGION = "us-east-1"
# moto needs credentials of some kind; these name no account anywhere.
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "derivd-bench",
    "AWS_SECRET_ACCESS_KEY": "derivd-bench-secret",
    "AWS_DEFAULT_REGION": REGION,
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}


THIS_BUILD = "this build"


@dataclass
class Run:
    round: int
    store: str
    workers: int
    pipeline: int
    images: int
    drain_s: float
    cpu_s: float
    peak_rss_mb: float
    build: str = THIS_BUILD
    wall_s: float = 0.0  # the whole `run --burst`, boot included
    moto_cpu_s: float = 0.0
    proxy_cpu_s: float = 0.0
    idle_core_s: float = 0.0  # the machine's, over wall_s
    cores: int = 1
    derive_s: float | None = None  # summed over the workers' `pipeline time` events
    between_s: float | None = None

    @property
    def idle_pct(self) -> float:
        return 100 * self.idle_core_s / (self.cores * self.wall_s) if self.wall_s else 0.0

    @property
    def busy_ms_per_image(self) -> float:
        """The machine's busy core time per image over the run."""
        busy = self.cores * self.wall_s - self.idle_core_s
        return busy / self.images * 1000 if self.images else 0.0

    @property
    def rig_ms_per_image(self) -> float:
        return (self.moto_cpu_s + self.proxy_cpu_s) / self.images * 1000 if self.images else 0.0

    @property
    def between_pct(self) -> float | None:
        if self.derive_s is None or self.between_s is None or not self.derive_s:
            return None
        return 100 * self.between_s / (self.derive_s + self.between_s)

    @property
    def images_per_s(self) -> float:
        return self.images / self.drain_s if self.drain_s > 0 else 0.0

    @property
    def cpu_ms_per_image(self) -> float:
        return self.cpu_s / self.images * 1000 if self.images else 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def moto(log: Path) -> Iterator[tuple[str, int]]:
    """moto's S3 server on 127.0.0.1; yields its URL and pid."""
    port = _free_port()
    script = Path(sys.executable).parent / "moto_server"
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "moto.server"]
    with log.open("ab") as out:
        proc = subprocess.Popen([*argv, "-H", "127.0.0.1", "-p", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(400):
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
                break
            except urllib.error.HTTPError:
                break
            except OSError:
                time.sleep(0.05)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(10)


def s3_bucket(url: str, name: str) -> None:
    import boto3

    client = boto3.session.Session().client("s3", endpoint_url=url, region_name=REGION)
    client.create_bucket(Bucket=name)
    client.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})


def queue_on_s3(dsn: str, url: str, bucket: str, originals: list[tuple[str, Path]]) -> None:
    from derivd.storage.s3 import S3Storage

    storage = S3Storage(bucket=bucket, endpoint_url=url, region=REGION)
    rows = [(key, storage.put(key, path.read_bytes(), "image/jpeg")) for key, path in originals]
    with psycopg.connect(dsn, autocommit=True) as conn:
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO archive_files (status, original_key, original_version)"
                            " VALUES ('queued', %s, %s)", rows)  # fmt: skip
        conn.execute("VACUUM (ANALYZE) archive_files")


def _process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _idle_s() -> float:
    """The machine's idle + iowait CPU seconds since boot (/proc/stat)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return (int(fields[3]) + int(fields[4])) / os.sysconf("SC_CLK_TCK")


PIPELINE_TIME = re.compile(r"pipeline time .*?derive_s=(\S+) .*?between_s=(\S+)")


def pipeline_time(log: Path) -> tuple[float, float] | None:
    """(derive s, waits between derives s) over the log's `pipeline time` events."""
    found = PIPELINE_TIME.findall(log.read_text(encoding="utf-8", errors="replace"))
    if not found:
        return None
    return sum(float(d) for d, _ in found), sum(float(b) for _, b in found)


@dataclass(frozen=True)
class Rig:
    """What every run shares: the S3 URLs and the processes whose CPU is the rig's."""

    urls: dict[str, str]
    moto_pid: int
    work: Path
    backend: str


def one_run(pg: Any, rnd: int, store: str, workers: int, pipeline: int, inputs: list[Path],
            rig: Rig, build: str, derivd: Path) -> Run:  # fmt: skip
    slug = re.sub(r"[^a-z0-9]+", "", build.lower())[:12]
    tag = f"r{rnd}_{slug}_{store.replace('+', '_')}_w{workers}_p{pipeline}"
    dsn = fresh_db(pg, f"sl_{tag}", derivd_schema=False)
    work, urls = rig.work, rig.urls
    originals = [(f"originals/{n:04d}", path) for n, path in enumerate(inputs)]
    if store == "fs":
        root = work / f"objects-{tag}"
        storage = f"backend = fs\nroot = {root}\n"
    else:
        bucket = f"sl-{tag.replace('_', '-').lower()}"
        storage = (f"backend = s3\nbucket = {bucket}\nendpoint_url = {urls[store]}\n"
                   f"region = {REGION}\n")  # fmt: skip
    ini = work / f"derivd-{tag}.ini"
    ini.write_text(
        f"[database]\ndsn = {dsn}\n[storage]\n{storage}"
        f"[supervisor]\nworkers = {workers}\npipeline = {pipeline}\n"
        f"state_dir = {work / 'state'}\n[queue]\nlisten = no\n"
        f"[derive]\nbackend = {rig.backend}\n",
        encoding="utf-8",
    )
    log = work / f"derivd-{tag}.log"
    with log.open("ab") as out:  # each build migrates its own database
        subprocess.run([str(derivd), "-c", str(ini), "migrate"], check=True, stdout=out,
                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)  # fmt: skip
    if store == "fs":
        store_and_queue(dsn, root, originals)
    else:
        s3_bucket(urls["s3"], bucket)
        queue_on_s3(dsn, urls["s3"], bucket, originals)  # uploads go straight to moto
    moto_cpu, own_cpu, idle = _process_cpu_s(rig.moto_pid), _own_cpu_s(), _idle_s()
    burst = burst_drain(ini, log, dsn, derivd=derivd)
    moto_cpu = _process_cpu_s(rig.moto_pid) - moto_cpu
    own_cpu, idle = _own_cpu_s() - own_cpu, _idle_s() - idle
    if burst.ready != len(inputs):
        raise SystemExit(f"{tag}: {len(inputs) - burst.ready} images unfinished; see the log")
    waits = pipeline_time(log)
    return Run(rnd, store, workers, pipeline, burst.ready, burst.drain_s, burst.cpu_s,
               burst.peak_rss_mb, build, burst.wall_s, moto_cpu, own_cpu, idle,
               os.cpu_count() or 1, *(waits or (None, None)))  # fmt: skip


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def medians(runs: list[Run]) -> list[dict[str, Any]]:
    """Per build and combination: its median round's images/s, and per round its ratio
    to the file store's images/s and the rig's bound (medians of those)."""
    builds = list(dict.fromkeys(r.build for r in runs))
    keys = sorted({(r.build, r.workers, r.pipeline, r.store) for r in runs},
                  key=lambda k: (k[1], k[2], builds.index(k[0]), STORES.index(k[3])))  # fmt: skip
    fs = {(r.build, r.round, r.workers, r.pipeline): r for r in runs if r.store == "fs"}
    rows = []
    for build, workers, pipeline, store in keys:
        key = (build, workers, pipeline, store)
        mine = [r for r in runs if (r.build, r.workers, r.pipeline, r.store) == key]
        middle = sorted(mine, key=lambda r: r.images_per_s)[len(mine) // 2]
        peers = [(r, fs[k]) for r in mine if (k := (build, r.round, workers, pipeline)) in fs]
        ratios = [r.images_per_s / f.images_per_s for r, f in peers if f.images_per_s]
        # What the cores allow once the rig's CPU comes on top of the file store's work.
        bounds = [f.busy_ms_per_image / (f.busy_ms_per_image + r.rig_ms_per_image)
                  for r, f in peers if f.busy_ms_per_image]  # fmt: skip
        between = [b for r in mine if (b := r.between_pct) is not None]
        rows.append({
            "build": build, "store": store, "workers": workers, "pipeline": pipeline,
            "images_per_s": middle.images_per_s,
            "cpu_ms_per_image": statistics.median(r.cpu_ms_per_image for r in mine),
            "moto_ms_per_image": statistics.median(r.moto_cpu_s / r.images * 1000 for r in mine),
            "proxy_ms_per_image": statistics.median(r.proxy_cpu_s / r.images * 1000 for r in mine),
            "idle_pct": statistics.median(r.idle_pct for r in mine),
            "peak_rss_mb": max(r.peak_rss_mb for r in mine),
            "vs_fs": _median(ratios),
            "rig_bound": _median(bounds) if store != "fs" else None,
            "between_derives_pct": _median(between),
            "rounds": [r.images_per_s for r in mine],
            "rounds_vs_fs": ratios,
        })  # fmt: skip
    return rows


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cores = os.cpu_count() or 1
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="each way")
    parser.add_argument("--workers", type=int, nargs="+", default=[cores, 3 * cores])
    parser.add_argument("--pipelines", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--stores", nargs="+", default=list(STORES), choices=STORES)
    parser.add_argument("--backend", default="vips")
    parser.add_argument("--refs", nargs="*", default=[],
                        help="other commits to run side by side (each built once)")  # fmt: skip
    args = parser.parse_args()
    os.environ.update(AWS_ENV)
    sys.path.insert(0, str(ROOT / "bench"))
    from sharp import phone_photos

    builds = [(THIS_BUILD, DERIVD)] + [
        (f"{ref} ({git('rev-parse', '--short', ref).strip()})", built(ref)) for ref in args.refs
    ]
    photos = phone_photos(ROOT / "bench" / "out" / "sharp-inputs")[:6]
    inputs = [photos[n % len(photos)] for n in range(args.images)]
    combos = [(s, w, p, b) for w in args.workers for p in args.pipelines for s in args.stores
              for b in builds]  # fmt: skip
    runs: list[Run] = []
    work = Path(tempfile.mkdtemp(prefix="derivd-store-latency-"))
    try:
        with cluster() as pg, moto(work / "moto.log") as (url, moto_pid):
            host, port = url.removeprefix("http://").split(":")
            with LatencyProxy((host, int(port)), args.delay_ms / 1000) as proxy:
                rig = Rig({"s3": url, "s3+40ms": proxy.url}, moto_pid, work, args.backend)
                print("\n".join(machine(pg.dsn("postgres"))))
                for rnd in range(args.rounds):
                    order = combos if rnd % 2 == 0 else combos[::-1]
                    for store, workers, pipeline, (build, derivd) in order:
                        run = one_run(pg, rnd, store, workers, pipeline, inputs, rig, build,
                                      derivd)  # fmt: skip
                        runs.append(run)
                        save(args, runs)  # after every run: an interrupted one keeps its data
                        print(
                            f"round {rnd + 1} {build[:16]:16} {store:8} workers {workers}"
                            f" pipeline {pipeline}: {run.images_per_s:5.2f} images/s,"
                            f" {run.cpu_ms_per_image:4.0f} CPU ms/image, moto"
                            f" {run.moto_cpu_s / run.images * 1000:3.0f}, proxy"
                            f" {run.proxy_cpu_s / run.images * 1000:3.0f}, idle"
                            f" {run.idle_pct:4.1f}%, between derives {_pct(run.between_pct)},"
                            f" peak RSS {run.peak_rss_mb:4.0f} MB",
                            flush=True,
                        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = medians(runs)
    print()
    print(table(["build", "store", "workers", "pipeline", "images/s", "vs fs", "rig bound",
                 "CPU ms/image", "moto ms/image", "proxy ms/image", "idle", "between derives",
                 "peak RSS MB"],
                [[r["build"], r["store"], r["workers"], r["pipeline"], r["images_per_s"],
                  _x(r["vs_fs"]), _x(r["rig_bound"]), r["cpu_ms_per_image"],
                  r["moto_ms_per_image"], r["proxy_ms_per_image"], _pct(r["idle_pct"]),
                  _pct(r["between_derives_pct"]), r["peak_rss_mb"]] for r in rows]))  # fmt: skip
    save(args, runs)


def save(args: argparse.Namespace, runs: list[Run]) -> None:
    save_results("store_latency", {
        "images": args.images, "rounds": max(r.round for r in runs) + 1,
        "delay_ms_each_way": args.delay_ms, "backend": args.backend,
        "builds": list(dict.fromkeys(r.build for r in runs)),
        "results": medians(runs), "runs": [asdict(r) for r in runs],
    })  # fmt: skip


if __name__ == "__main__":
    main()
