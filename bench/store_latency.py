"""A far object store against a near one: `derivd run --burst` on the file store, on S3
over loopback (moto's server) and on S3 40 ms away (the same server behind a latency
proxy, 20 ms each way), with one worker per core and three per core, pipeline 1 and 2.

    .venv/bin/python bench/store_latency.py [--images 48] [--rounds 2] [--delay-ms 20]
        [--workers N M] [--pipelines 1 2] [--backend vips]

The images are the six 12 MP phone JPEGs of bench/sharp.py, cycled to `--images` jobs,
with the default variants. Every run gets a fresh database on one embedded PostgreSQL
(fsync on) and its originals stored (untimed) in the store under test. Each round runs
every combination once, in an order reversed on odd rounds (interleaved: the neighbours'
load falls on every side alike); the table shows each combination's median round.

- images/s: ready rows / (first claim to last finish, database clock);
- CPU/image: user + system CPU of the supervisor and its workers per image (boot
  included; PostgreSQL's, moto's and the proxy's not);
- peak RSS: the largest process of the run, a worker (getrusage of the waited children);
- vs fs: images/s over the file store's at the same workers and pipeline, same round.

Writes bench/out/store_latency.json (bench/plots.py draws chart-store_latency.png).
"""

from __future__ import annotations

import argparse
import contextlib
import os
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
    ROOT,
    burst_drain,
    cluster,
    fresh_db,
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
def moto(log: Path) -> Iterator[str]:
    """moto's S3 server on 127.0.0.1; yields its URL."""
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
        yield url
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


def one_run(pg: Any, rnd: int, store: str, workers: int, pipeline: int, inputs: list[Path],
            work: Path, urls: dict[str, str], backend: str) -> Run:  # fmt: skip
    tag = f"r{rnd}_{store.replace('+', '_')}_w{workers}_p{pipeline}"
    dsn = fresh_db(pg, f"sl_{tag}")
    originals = [(f"originals/{n:04d}", path) for n, path in enumerate(inputs)]
    if store == "fs":
        root = work / f"objects-{tag}"
        store_and_queue(dsn, root, originals)
        storage = f"backend = fs\nroot = {root}\n"
    else:
        bucket = f"sl-{tag.replace('_', '-').lower()}"
        s3_bucket(urls["s3"], bucket)
        queue_on_s3(dsn, urls["s3"], bucket, originals)  # uploads go straight to moto
        storage = (f"backend = s3\nbucket = {bucket}\nendpoint_url = {urls[store]}\n"
                   f"region = {REGION}\n")  # fmt: skip
    ini = work / f"derivd-{tag}.ini"
    ini.write_text(
        f"[database]\ndsn = {dsn}\n[storage]\n{storage}"
        f"[supervisor]\nworkers = {workers}\npipeline = {pipeline}\n"
        f"state_dir = {work / 'state'}\n[queue]\nlisten = no\n[derive]\nbackend = {backend}\n",
        encoding="utf-8",
    )
    burst = burst_drain(ini, work / f"derivd-{tag}.log", dsn)
    if burst.ready != len(inputs):
        raise SystemExit(f"{tag}: {len(inputs) - burst.ready} images unfinished; see the log")
    return Run(rnd, store, workers, pipeline, burst.ready, burst.drain_s, burst.cpu_s,
               burst.peak_rss_mb)  # fmt: skip


def medians(runs: list[Run]) -> list[dict[str, Any]]:
    """Per combination: its median round's figures, and its ratio to the file store's
    images/s in each round (median of the ratios)."""
    keys = sorted({(r.workers, r.pipeline, r.store) for r in runs},
                  key=lambda k: (k[0], k[1], STORES.index(k[2])))  # fmt: skip
    fs = {(r.round, r.workers, r.pipeline): r.images_per_s for r in runs if r.store == "fs"}
    rows = []
    for workers, pipeline, store in keys:
        mine = [r for r in runs if (r.workers, r.pipeline, r.store) == (workers, pipeline, store)]
        middle = sorted(mine, key=lambda r: r.images_per_s)[len(mine) // 2]
        ratios = [r.images_per_s / fs[(r.round, workers, pipeline)] for r in mine
                  if fs.get((r.round, workers, pipeline))]  # fmt: skip
        rows.append({
            "store": store, "workers": workers, "pipeline": pipeline,
            "images_per_s": middle.images_per_s,
            "cpu_ms_per_image": statistics.median(r.cpu_ms_per_image for r in mine),
            "peak_rss_mb": max(r.peak_rss_mb for r in mine),
            "vs_fs": statistics.median(ratios) if ratios else None,
            "rounds": [r.images_per_s for r in mine],
        })  # fmt: skip
    return rows


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
    args = parser.parse_args()
    os.environ.update(AWS_ENV)
    sys.path.insert(0, str(ROOT / "bench"))
    from sharp import phone_photos

    photos = phone_photos(ROOT / "bench" / "out" / "sharp-inputs")[:6]
    inputs = [photos[n % len(photos)] for n in range(args.images)]
    combos = [(s, w, p) for w in args.workers for p in args.pipelines for s in args.stores]
    runs: list[Run] = []
    work = Path(tempfile.mkdtemp(prefix="derivd-store-latency-"))
    try:
        with cluster() as pg, moto(work / "moto.log") as url:
            host, port = url.removeprefix("http://").split(":")
            with LatencyProxy((host, int(port)), args.delay_ms / 1000) as proxy:
                urls = {"s3": url, "s3+40ms": proxy.url}
                print("\n".join(machine(pg.dsn("postgres"))))
                for rnd in range(args.rounds):
                    order = combos if rnd % 2 == 0 else combos[::-1]
                    for store, workers, pipeline in order:
                        run = one_run(pg, rnd, store, workers, pipeline, inputs, work, urls,
                                      args.backend)  # fmt: skip
                        runs.append(run)
                        save(args, runs)  # after every run: an interrupted one keeps its data
                        print(
                            f"round {rnd + 1} {store:8} workers {workers} pipeline {pipeline}:"
                            f" {run.images_per_s:5.2f} images/s, {run.cpu_ms_per_image:4.0f}"
                            f" CPU ms/image, peak RSS {run.peak_rss_mb:4.0f} MB",
                            flush=True,
                        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = medians(runs)
    print()
    print(table(["store", "workers", "pipeline", "images/s", "vs fs", "CPU ms/image",
                 "peak RSS MB"],
                [[r["store"], r["workers"], r["pipeline"], r["images_per_s"],
                  "-" if r["vs_fs"] is None else f"{r['vs_fs']:.2f}x", r["cpu_ms_per_image"],
                  r["peak_rss_mb"]] for r in rows]))  # fmt: skip
    save(args, runs)


def save(args: argparse.Namespace, runs: list[Run]) -> None:
    save_results("store_latency", {
        "images": args.images, "rounds": max(r.round for r in runs) + 1,
        "delay_ms_each_way": args.delay_ms, "backend": args.backend,
        "results": medians(runs), "runs": [asdict(r) for r in runs],
    })  # fmt: skip


if __name__ == "__main__":
    main()
