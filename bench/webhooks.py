"""Webhooks: what the outbox costs the derivation commit, and how fast and at
what server cost its events reach a local receiver.

1. Server CPU per job of the worker's commit (+ next claim, one statement, one client,
   prepared, two variants per job), interleaved rounds of: the baseline build (git ref,
   before webhooks), this build without any endpoint, this build with one endpoint
   subscribed (its deliveries pile up: nothing delivers during this part).
2. Commit-to-delivery latency: one file at a time is committed and the next one only
   once the receiver (a thread of this process, 127.0.0.1, verifying each request with
   the `standardwebhooks` library) has it; the delivering loop runs in a child process,
   woken by the outbox's NOTIFY. p50/p99 from the commit's return to the request's
   arrival.
3. Throughput: a backlog of deliveries, then the deliverer started: deliveries/s and the
   server's CPU per delivery (claim + fenced finish), at concurrency 4 and 16.
4. Sides (`--build REF`, default main): commit-to-delivery p50/p99 of REF and of this
   build in the same run, rounds interleaved, each side's deliverer its own build (REF's
   sources exported from git, its schema from its migrations); and the recovery after a
   receiver outage of `--outage` seconds (files committed all along it, defaults
   everywhere): from the receiver's return to the first delivery and to the last.

    .venv/bin/python bench/webhooks.py            # writes bench/out/webhooks.json
    .venv/bin/python bench/webhooks.py --parts sides --build main
"""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import OUT, cluster, fresh_db, git, machine, percentile, save_results, table
from fleet import load_average, server_cpu_s
from traffic import baseline_db

from derivd.queue.db import QueueDB
from derivd.webhooks.deliverer import Deliverer
from derivd.webhooks.endpoints import Endpoint

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "support")
)
from fixtures.receiver import Receiver

KEY = b"derivd bench secret of 32 bytes!"
SECRET = "whsec_" + base64.b64encode(KEY).decode()
COMMIT = "SELECT * FROM derivd_commit_and_claim(%(jobs)s::jsonb, 1, 120, 3, 'b', 0)"
SEED = """INSERT INTO archive_files (status, original_key, original_version)
SELECT 'queued', 'originals/bench', 'v1' FROM generate_series(1, %(n)s)"""
SUBSCRIBE = [{"name": "app", "events": ["file.ready", "file.rejected"], "tenants": None}]


def variants(file_id: int, token: str) -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "key": f"derived/{file_id}/{token}/{name}.webp",
            "version": "v1",
            "sha256": "ab" * 32,
            "width": edge,
            "height": edge // 2,
            "format": "webp",
            "content_type": "image/webp",
            "fingerprint": "f",
        }
        for name, edge in (("preview", 1600), ("thumb", 320))
    ]


def commit_loop(conn: psycopg.Connection[Any], n: int) -> Callable[[], None]:
    held: list[tuple[Any, ...]] = []

    def one() -> None:
        jobs = json.dumps([{"id": r[1], "token": str(r[2]), "attempt": r[3],
                            "derived_key": "k", "derived_version": "v", "sha256": "ab" * 32,
                            "width": 1600, "height": 800,
                            "variants": variants(r[1], str(r[2]))} for r in held])  # fmt: skip
        rows = conn.execute(COMMIT, {"jobs": jobs}, prepare=True).fetchall()
        held[:] = [r for r in rows if r[0] == "claimed"]

    return one


def commit_cpu(pg: Any, label: str, baseline: str, jobs: int) -> float:
    """Server CPU ms per job of commit + next claim."""
    dsn = (baseline_db(pg, "wh_cpu_base", baseline) if label == "baseline"
           else fresh_db(pg, "wh_cpu"))  # fmt: skip
    if label == "one endpoint":
        with QueueDB.open(dsn) as q:
            q.sync_webhook_endpoints(SUBSCRIBE)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SEED, {"n": jobs + 400})
        conn.execute("VACUUM (ANALYZE) archive_files")
        conn.execute("CHECKPOINT")
        one = commit_loop(conn, jobs)
        for _ in range(200):
            one()
        before = server_cpu_s(pg)
        for _ in range(jobs):
            one()
        return (server_cpu_s(pg) - before) * 1000 / jobs


PROBE = """CREATE FUNCTION bench_probe(n integer, check_it boolean) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    hooks boolean;
BEGIN
    FOR i IN 1 .. n LOOP
        hooks := NULL;
        IF check_it AND hooks IS NULL THEN
            hooks := derivd_webhooks_on();  -- what derivd_commit_outcomes does once per call
        END IF;
    END LOOP;
END $$"""


def probe_cost(pg: Any, n: int = 200_000, rounds: int = 5) -> dict[str, float]:
    """Microseconds per call of the check every commit makes (no endpoint), and of the
    empty loop around it: the check's whole cost, apart from a commit's noise."""
    dsn = fresh_db(pg, "wh_probe")
    runs: dict[bool, list[float]] = {False: [], True: []}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(PROBE)
        for _ in range(rounds):
            for check_it in (False, True):
                started = time.perf_counter()
                conn.execute("SELECT bench_probe(%s, %s)", (n, check_it))
                runs[check_it].append((time.perf_counter() - started) / n * 1e6)
    loop = statistics.median(runs[False])
    return {"loop": loop, "check": statistics.median(runs[True]) - loop}


def endpoint(url: str, concurrency: int) -> Endpoint:
    return Endpoint("app", url, KEY, timeout=10, retry_horizon=3600, concurrency=concurrency)


def _deliver(dsn: str, url: str, concurrency: int) -> None:
    deliverer = Deliverer((endpoint(url, concurrency),), dsn, host="bench", poll_interval=1.0)
    deliverer.run()


def start_deliverer(dsn: str, url: str, concurrency: int) -> multiprocessing.Process:
    proc = multiprocessing.get_context("fork").Process(
        target=_deliver, args=(dsn, url, concurrency), daemon=True
    )
    proc.start()
    return proc


class Arrivals:
    def __init__(self, receiver: Receiver) -> None:
        self.at: dict[int, float] = {}
        self.cond = threading.Condition()
        original = receiver.record

        def record(item: Any) -> None:
            original(item)
            with self.cond:
                self.at.setdefault(item.payload["data"]["file_id"], time.time())
                self.cond.notify_all()

        receiver.record = record  # type: ignore[method-assign]

    def wait(self, count: int, timeout: float = 120.0) -> None:
        with self.cond:
            self.cond.wait_for(lambda: len(self.at) >= count, timeout)


def latency(pg: Any, events: int) -> dict[str, float]:
    dsn = fresh_db(pg, "wh_latency")
    receiver = Receiver(SECRET).start()
    arrivals = Arrivals(receiver)
    with QueueDB.open(dsn) as q:
        q.sync_webhook_endpoints(SUBSCRIBE)
    proc = start_deliverer(dsn, receiver.url, 4)
    lat: list[float] = []
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SEED, {"n": events + 21})
            one = commit_loop(conn, events)
            one()  # the first claim
            for n in range(events + 20):
                held = conn.execute("SELECT id FROM archive_files WHERE status = 'processing'")
                ids = [int(r[0]) for r in held.fetchall()]
                expected = len(arrivals.at) + len(ids)  # before the commit: it may arrive
                one()  # before the next line runs
                done = time.time()
                arrivals.wait(expected)
                if n >= 20:  # warm-up: connections, plans
                    lat += [(arrivals.at[i] - done) * 1000 for i in ids if i in arrivals.at]
    finally:
        proc.terminate()
        proc.join(30)
        receiver.stop()
    bad = [r for r in receiver.answered() if not r.verified]
    assert not bad, "a signature did not verify"
    return {"p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99), "n": len(lat),
            "mean_ms": statistics.fmean(lat)}  # fmt: skip


def throughput(pg: Any, backlog: int, concurrency: int) -> dict[str, float]:
    dsn = fresh_db(pg, "wh_throughput")
    receiver = Receiver(SECRET).start()
    arrivals = Arrivals(receiver)
    with QueueDB.open(dsn) as q:
        q.sync_webhook_endpoints(SUBSCRIBE)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SEED, {"n": backlog + 1})
        one = commit_loop(conn, backlog)
        for _ in range(backlog + 1):
            one()
        conn.execute("VACUUM (ANALYZE) derivd_deliveries")
    cpu, started = server_cpu_s(pg), time.monotonic()
    proc = start_deliverer(dsn, receiver.url, concurrency)
    try:
        arrivals.wait(backlog, timeout=600)
        wall = time.monotonic() - started
        cpu = server_cpu_s(pg) - cpu
    finally:
        proc.terminate()
        proc.join(30)
        receiver.stop()
    got = len(arrivals.at)
    return {"deliveries_per_s": got / wall, "server_cpu_ms_per_delivery": cpu * 1000 / got,
            "delivered": got}  # fmt: skip


# -- sides: REF's build beside this one ------------------------------------------------

THIS = "this build"
DELIVER = """
import sys
from derivd.webhooks.deliverer import Deliverer
from derivd.webhooks.endpoints import Endpoint
dsn, url, key = sys.argv[1], sys.argv[2], sys.argv[3].encode()
Deliverer((Endpoint("app", url, key, timeout=10, concurrency=4),), dsn, host="bench",
          poll_interval=1.0).run()
"""


def export_build(ref: str, into: Path) -> Path:
    """REF's `derivd` package, laid out as the editable install lays this one out."""
    archive = subprocess.run(["git", "archive", ref, "supervisor", "sql", "handlers"],
                             check=True, capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    package = into / "pkg" / "derivd"
    package.parent.mkdir()
    (into / "supervisor").rename(package)
    (into / "sql").rename(package / "sql")
    (into / "handlers").rename(package / "handlers")
    return into / "pkg"


def side_deliverer(dsn: str, url: str, path: Path | None) -> subprocess.Popen[bytes]:
    """The delivering loop of one side, a process of its own (REF's: its sources first)."""
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = str(path)
    return subprocess.Popen([sys.executable, "-c", DELIVER, dsn, url, KEY.decode()], env=env)


def side_db(pg: Any, side: str, ref: str, name: str) -> str:
    return fresh_db(pg, name) if side == THIS else baseline_db(pg, name + "_ref", ref)


def side_latency(pg: Any, side: str, ref: str, path: Path | None, events: int) -> list[float]:
    """Commit-to-delivery ms of `events` files, one at a time, on one side."""
    dsn = side_db(pg, side, ref, "wh_side_latency")
    receiver = Receiver(SECRET).start()
    arrivals = Arrivals(receiver)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO derivd_webhook_endpoints (name, events) VALUES"
                     " ('app', '{file.ready,file.rejected}')")  # fmt: skip
    proc = side_deliverer(dsn, receiver.url, path)
    lat: list[float] = []
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SEED, {"n": events + 21})
            one = commit_loop(conn, events)
            one()  # the first claim
            for n in range(events + 20):
                held = conn.execute("SELECT id FROM archive_files WHERE status = 'processing'")
                ids = [int(r[0]) for r in held.fetchall()]
                expected = len(arrivals.at) + len(ids)  # before the commit: it may arrive
                one()  # before the next line runs
                done = time.time()
                arrivals.wait(expected)
                if n >= 20:  # warm-up: connections, plans
                    lat += [(arrivals.at[i] - done) * 1000 for i in ids if i in arrivals.at]
    finally:
        proc.terminate()
        proc.wait(30)
        receiver.stop()
    assert all(r.verified for r in receiver.answered()), "a signature did not verify"
    return lat


def side_recovery(
    pg: Any, side: str, ref: str, path: Path | None, outage_s: float, wait_s: float
) -> dict[str, float | None]:
    """A receiver down for `outage_s` while a file is committed every half second: from
    its return, seconds to the first delivery and to the last (None: not within wait_s)."""
    dsn = side_db(pg, side, ref, "wh_side_recovery")
    receiver = Receiver(SECRET).start()
    arrivals = Arrivals(receiver)
    most = int(outage_s * 2) + 1  # a file every half second at most
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO derivd_webhook_endpoints (name, events) VALUES"
                     " ('app', '{file.ready,file.rejected}')")  # fmt: skip
    proc = side_deliverer(dsn, receiver.url, path)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SEED, {"n": most + 12})
            one = commit_loop(conn, most + 10)
            one()
            for _ in range(5):
                one()
            arrivals.wait(5)
            before = len(arrivals.at)
            receiver.stop()
            down, files = time.monotonic(), 0
            while time.monotonic() - down < outage_s:
                one()
                files += 1
                time.sleep(0.5)
            receiver.start()  # the same port
            up = time.time()
        arrivals.wait(before + files, timeout=wait_s)
    finally:
        proc.terminate()
        proc.wait(30)
        receiver.stop()
    late = sorted(t - up for t in arrivals.at.values() if t >= up)
    complete = len(arrivals.at) >= before + files
    return {"first_s": late[0] if late else None,
            "all_s": late[-1] if complete and late else None,
            "files": files, "delivered": len(late)}  # fmt: skip


def sides(pg: Any, ref: str, rounds: int, events: int, outage_s: float) -> dict[str, Any]:
    """REF beside this build: latency rounds interleaved, then each side's recovery."""
    with tempfile.TemporaryDirectory(prefix="derivd-ref-") as tmp:
        path = export_build(ref, Path(tmp))
        builds: dict[str, Path | None] = {ref: path, THIS: None}
        lat: dict[str, list[float]] = {side: [] for side in builds}
        for n in range(rounds):
            for side in list(builds)[:: 1 if n % 2 == 0 else -1]:
                print(f"latency, {side}, round {n + 1}", file=sys.stderr, flush=True)
                lat[side] += side_latency(pg, side, ref, builds[side], events)
        recovery = {}
        for side, where in builds.items():
            print(f"recovery after {outage_s:g} s, {side}", file=sys.stderr, flush=True)
            recovery[side] = side_recovery(pg, side, ref, where, outage_s, wait_s=900)
    return {
        "ref": ref,
        "commit": git("rev-parse", "--short", ref).strip(),
        "latency": {
            side: {"p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99), "n": len(v)}
            for side, v in lat.items()
        },
        "outage_s": outage_s,
        "recovery": recovery,
    }


def print_sides(result: dict[str, Any]) -> None:
    def seconds(value: float | None) -> str:
        return "> 900 s" if value is None else f"{value:.1f} s"

    print(f"\n4. {result['ref']} ({result['commit']}) beside this build")
    print(table(["build", "p50 ms", "p99 ms", "n", f"first after a {result['outage_s']:g} s "
                 "outage", "all of its backlog"],
                [[side, f"{v['p50_ms']:.1f}", f"{v['p99_ms']:.1f}", v["n"],
                  seconds(result["recovery"][side]["first_s"]),
                  seconds(result["recovery"][side]["all_s"])]
                 for side, v in result["latency"].items()]))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=3000, help="per commit-cost round")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--events", type=int, default=300)
    parser.add_argument("--backlog", type=int, default=2000)
    parser.add_argument("--baseline", default="7328005", help="git ref before webhooks (main)")
    parser.add_argument(
        "--parts",
        default="commit,probe,latency,throughput",
        help="which parts to run (comma-separated; sides: REF beside this build)",
    )
    parser.add_argument("--build", default="main", help="the git ref of `sides`")
    parser.add_argument("--rounds", type=int, default=3, help="latency rounds of `sides`")
    parser.add_argument("--outage", type=float, default=60.0, help="seconds, `sides`")
    args = parser.parse_args()
    load = [load_average()]
    result: dict[str, Any] = {}
    parts = set(args.parts.split(","))
    with cluster() as pg:
        labels = ("baseline", "no endpoint", "one endpoint") if "commit" in parts else ()
        cpu: dict[str, list[float]] = {label: [] for label in labels}
        for n in range(args.repeat):
            order = labels if n % 2 == 0 else labels[::-1]  # neither side always first
            for label in order:
                print(f"commit cost, {label}, round {n + 1}", file=sys.stderr, flush=True)
                cpu[label].append(commit_cpu(pg, label, args.baseline, args.jobs))
        result["commit_cpu_ms"] = {k: {"median": statistics.median(v), "runs": v}
                                   for k, v in cpu.items() if v}  # fmt: skip
        if "probe" in parts:
            print("the endpoint check alone", file=sys.stderr, flush=True)
            result["probe_us"] = probe_cost(pg)
        if "latency" in parts:
            print("latency", file=sys.stderr, flush=True)
            result["latency"] = latency(pg, args.events)
        result["throughput"] = {}
        for concurrency in (4, 16) if "throughput" in parts else ():
            print(f"throughput, concurrency {concurrency}", file=sys.stderr, flush=True)
            result["throughput"][str(concurrency)] = throughput(pg, args.backlog, concurrency)
        if "sides" in parts:
            result["sides"] = sides(pg, args.build, args.rounds, args.events, args.outage)
        load.append(load_average())
        result["machine"] = machine(pg.dsn("postgres"))
    # The chart's title shows the load of the run that measured the commit's cost.
    result["load" if "commit" in parts else "load_" + "_".join(sorted(parts))] = load
    print("\n".join(result["machine"]))
    print(f"load average before/after: {load[0]} / {load[1]}")
    if result["commit_cpu_ms"]:
        base = result["commit_cpu_ms"]["baseline"]["median"]
        print("\n1. server CPU per job, commit + next claim (median of rounds)")
        print(table(["build", "ms/job", "vs baseline", "runs"],
                    [[k, f"{v['median']:.4f}", f"{(v['median'] / base - 1) * 100:+.1f} %",
                      " ".join(f"{r:.4f}" for r in v["runs"])]
                     for k, v in result["commit_cpu_ms"].items()]))  # fmt: skip
    if "probe_us" in result:
        p = result["probe_us"]
        print(
            f"\n1b. the endpoint check alone (derivd_webhooks_on, no endpoint): "
            f"{p['check']:.2f} us per commit call (loop overhead {p['loop']:.2f} us)"
        )
    if "latency" in result:
        lat = result["latency"]
        print(f"\n2. commit to delivery: p50 {lat['p50_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms "
              f"(mean {lat['mean_ms']:.1f}, n = {lat['n']})")  # fmt: skip
    if "sides" in result:
        print_sides(result["sides"])
    if result["throughput"]:
        print("\n3. a backlog of deliveries")
        print(table(["concurrency", "deliveries/s", "server CPU ms/delivery"],
                    [[c, f"{t['deliveries_per_s']:.0f}", f"{t['server_cpu_ms_per_delivery']:.3f}"]
                     for c, t in result["throughput"].items()]))  # fmt: skip
    # A run of some parts keeps the other parts' latest figures (bench/plots.py draws all).
    previous = OUT / "webhooks.json"
    kept = json.loads(previous.read_text()) if previous.exists() else {}
    kept.update({k: v for k, v in result.items() if v})
    save_results("webhooks", kept)


if __name__ == "__main__":
    main()
