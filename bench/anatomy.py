"""`python bench/anatomy.py`: where a `derivd run --burst` spends its CPU, by role, per image.

bench/sharp.py says how fast derivd does sharp's task beside sharp and the plain-library
floor; bench/steps.py times the handler's steps alone. This one runs the same task
(copies of sharp's fixture, 720x588 cover JPEG q80, the fs store, one worker per core)
and reads every thread's CPU from /proc while it runs, so the daemon around the pixels
is measured in place, with both cores busy:

    supervisor            the parent: its boot (imports, the schema check, the host
                          registry), then the fleet's bookkeeping and duties
    worker main thread    the derivation: decode, resize, encode, analysis
    libvips threads       libvips' pool and write-behind threads, the same work
    worker's other threads  the store-and-commit lane (PUT, fenced commit with the next
                          claim, the reports), the original's GET, the heartbeat
    PostgreSQL            the server's processes (its backends, WAL writer, ...)
    this sampler          reading /proc every --interval
    idle or elsewhere     the cores' time nobody above used (another load counts here)

and the run's timeline from the rows: the boot (the command's start to the first claim),
the drain (first claim to last finish) and the tail (last finish to the exit). A thread's
CPU is read every --interval and kept from its last reading, so each thread's last
interval before it exits is missed: "not attributed" is the rest of derivd's own CPU, as
the kernel accounted it at the exit. Linux only (/proc/PID/task/TID/children).

    .venv/bin/python bench/anatomy.py --fixture /path/to/2569067123_aca715a2ee_o.jpg \\
        --rounds 3 --build HEAD~1            # bench/out/anatomy.json, chart-anatomy.png

`--build REF` adds derivd as REF builds it (bench/common.built), round by round beside
this tree: where a change moved the CPU, not only how much.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common import (
    DERIVD,
    built,
    cluster,
    compile_derivd,
    drained,
    fresh_db,
    machine,
    save_results,
    table,
)
from sharp import BOX, QUALITY, queued_task, sharp_fixture

from derivd.embedded.pgcluster import EmbeddedCluster

TICK_S = 1 / os.sysconf("SC_CLK_TCK")
# derivd's own (their sum is checked against the kernel's total at the exit), then the rest.
DERIVD_ROLES = (
    "supervisor",
    "worker main thread",
    "libvips threads",
    "worker's other threads",
    "other children",
)
ROLES = (*DERIVD_ROLES, "PostgreSQL", "this sampler", "not attributed", "idle or elsewhere")


def thread_cpu_s(pid: int, tid: int) -> float | None:
    """User + system CPU seconds of one thread so far, None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return (int(fields[11]) + int(fields[12])) * TICK_S  # utime, stime


def children(pid: int) -> list[int]:
    """The processes `pid`'s threads forked (derivd forks from its main thread only; the
    postmaster is single-threaded)."""
    found: list[int] = []
    for tid in tasks(pid):
        try:
            found += map(int, Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
        except OSError:
            continue
    return found


def tasks(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def comm(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


def process_kind(name: str) -> str | None:
    """A derivd child by its title: "worker", "other" (sweep, webhooks), or None while
    it is still untitled ("derivd", its parent's name, right after the fork)."""
    if name.startswith("derivd: worker"):
        return "worker"
    return "other" if name.startswith("derivd: ") else None


def role(root: int, pid: int, tid: int, kind: str | None, thread_name: str) -> str:
    """Which row a thread's CPU goes to (the module docstring's roles); an untitled child
    is a worker booting (workers are what a burst forks)."""
    if pid == root:
        return "supervisor"
    if kind == "other":
        return "other children"
    if tid == pid:
        return "worker main thread"
    if thread_name.startswith(("libvips", "vips")):
        return "libvips threads"
    return "worker's other threads"


@dataclass
class Threads:
    """The last CPU reading of every thread seen, with its role."""

    cpu: dict[tuple[int, int], float] = field(default_factory=dict)
    roles: dict[tuple[int, int], str] = field(default_factory=dict)
    kinds: dict[int, str] = field(default_factory=dict)  # titled derivd children
    start: dict[tuple[int, int], float] = field(default_factory=dict)  # before the run

    def read(self, pid: int, root: int, server: bool = False) -> None:
        """Every thread of `pid`, one of derivd's or (`server`) of PostgreSQL's."""
        kind = self.kinds.get(pid)
        if not server and kind is None and pid != root:
            kind = process_kind(comm(pid, pid))
            if kind is not None:
                self.kinds[pid] = kind
                self.roles = {k: v for k, v in self.roles.items() if k[0] != pid}
        for tid in tasks(pid):
            key = (pid, tid)
            used = thread_cpu_s(pid, tid)
            if used is None:
                continue
            if key not in self.roles:
                self.roles[key] = (
                    "PostgreSQL" if server else role(root, pid, tid, kind, comm(pid, tid))
                )
            self.cpu[key] = used

    def by_role(self) -> dict[str, float]:
        totals = dict.fromkeys(ROLES, 0.0)
        for key, used in self.cpu.items():
            totals[self.roles[key]] += used - self.start.get(key, 0.0)
        return totals


def server_processes(postmaster: int) -> Iterator[int]:
    yield postmaster
    yield from children(postmaster)


def sample(root: int, postmaster: int, interval: float, done: threading.Event) -> Threads:
    """Read derivd's threads (`root` and its children) and the server's processes until
    `done` (the caller reaps `root`: a poll here would race it)."""
    seen = Threads()
    for pid in server_processes(postmaster):  # what the server had used before the run
        seen.read(pid, root, server=True)
    seen.start = dict(seen.cpu)
    while not done.wait(interval):
        for pid in (root, *children(root)):
            seen.read(pid, root)
        for pid in server_processes(postmaster):
            seen.read(pid, root, server=True)
    return seen


def sampled(argv: list[str], log: Path, postmaster: int, interval: float
            ) -> tuple[int, float, Threads, float]:  # fmt: skip
    """Run `argv` to its end (output to `log`) while a thread samples it: (exit status, CPU
    s of it and every child it waited for, the threads' readings, the sampler's CPU s)."""
    readings: list[Threads] = []
    sampler_s: list[float] = []
    done = threading.Event()

    def watch() -> None:
        begun = time.thread_time()
        readings.append(sample(proc.pid, postmaster, interval, done))
        sampler_s.append(time.thread_time() - begun)

    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)  # fmt: skip
        sampler = threading.Thread(target=watch)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        done.set()
        sampler.join()
    return proc.returncode, usage.ru_utime + usage.ru_stime, readings[0], sampler_s[0]


@dataclass
class Run:
    """One `run --burst` of one side, taken apart."""

    side: str
    round: int
    images: int
    wall_s: float
    boot_s: float  # the command's start to the first claim
    drain_s: float  # first claim to last finish
    tail_s: float  # last finish to the exit
    cpu_s: dict[str, float]  # by role
    load_1min: float

    @property
    def images_per_s(self) -> float:
        return self.images / self.wall_s

    def ms_per_image(self, name: str) -> float:
        return self.cpu_s[name] / self.images * 1000


def one_run(pg: EmbeddedCluster, derivd: Path, side: str, rnd: int, fixture: Path,
            args: argparse.Namespace, work: Path) -> Run:  # fmt: skip
    tag = f"a{rnd}_{len(list(work.glob('*.ini')))}"
    dsn = fresh_db(pg, tag)
    ini = queued_task(dsn, work / f"objects-{tag}", [fixture] * args.images, args.backend,
                      args.workers, work / f"{tag}.ini")  # fmt: skip
    postmaster = int((pg.data_dir / "postmaster.pid").read_text().split()[0])
    compile_derivd()  # as burst_drain does: no run pays for writing bytecode
    load = os.getloadavg()[0]
    log = work / f"{tag}.log"
    started = time.time()
    code, own, threads, sampler_s = sampled([str(derivd), "-c", str(ini), "run", "--burst"],
                                            log, postmaster, args.interval)  # fmt: skip
    wall = time.time() - started
    if code != 0:
        raise SystemExit(f"derivd ({side}) exited {code}: see {log}")
    ready, first, last = drained(dsn)
    if ready != args.images:
        raise SystemExit(f"derivd ({side}) left {args.images - ready} images unfinished")
    cpu = threads.by_role()
    cpu["this sampler"] = sampler_s
    cpu["not attributed"] = max(0.0, own - sum(cpu[r] for r in DERIVD_ROLES))
    used = sum(cpu[r] for r in ROLES if r != "idle or elsewhere")
    cpu["idle or elsewhere"] = max(0.0, args.workers * wall - used)
    return Run(side, rnd, args.images, wall, first - started, last - first, started + wall - last,
               cpu, load)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixture", type=Path, help="a local copy of sharp's fixture")
    parser.add_argument("--images", type=int, default=240)
    parser.add_argument("--backend", default="vips", choices=["vips", "pillow"])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="derivd workers; the cores counted for idle (default: one per "
                        "core)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--interval", type=float, default=0.025,
                        help="seconds between two readings of /proc")  # fmt: skip
    parser.add_argument(
        "--build",
        action="append",
        default=[],
        metavar="REF",
        help="also derivd as REF builds it, in the same rounds; repeatable",
    )
    parser.add_argument("--label", default="", help="written as bench/out/anatomy-LABEL.json")
    args = parser.parse_args()
    fixture = sharp_fixture(args.fixture)
    if fixture is None:
        raise SystemExit("anatomy: sharp's fixture is needed (--fixture PATH)")
    sides = {"this tree": DERIVD, **{f"#{ref}": built(ref) for ref in args.build}}
    runs: list[Run] = []
    with cluster() as pg, tempfile.TemporaryDirectory(prefix="derivd-anatomy-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        for rnd in range(args.rounds):
            for side, derivd in sides.items():
                runs.append(one_run(pg, derivd, side, rnd, fixture, args, work))
                print(f"round {rnd + 1} {side}: {runs[-1].images_per_s:.1f} images/s",
                      file=sys.stderr, flush=True)  # fmt: skip
        lines = machine(pg.dsn())
    lines.append(f"{args.images} copies of sharp's fixture, {BOX[0]}x{BOX[1]} cover JPEG "
                 f"q{QUALITY}, backend {args.backend}, {args.workers} workers, fs store; "
                 f"/proc read every {args.interval * 1000:.0f} ms; medians of "
                 f"{args.rounds} round(s)")  # fmt: skip
    print("\n".join(lines))
    print(report(runs, list(sides)))
    path = save_results(f"anatomy-{args.label}" if args.label else "anatomy", {
        "machine": lines, "label": args.label, "backend": args.backend, "roles": list(ROLES),
        "runs": [asdict(r) | {"images_per_s": r.images_per_s} for r in runs],
    })  # fmt: skip
    print(f"wrote {path}")


def report(runs: list[Run], sides: list[str]) -> str:
    """One column per side: CPU ms per image by role, then the timeline (medians)."""

    def median(side: str, value: Callable[[Run], float]) -> float:
        return statistics.median(value(r) for r in runs if r.side == side)

    rows: list[list[object]] = []
    for name in ROLES:
        rows.append([f"{name}, CPU ms/image",
                     *(median(s, lambda r, n=name: r.ms_per_image(n)) for s in sides)])  # fmt: skip
    timeline: list[tuple[str, Callable[[Run], float]]] = [
        ("images/s", lambda r: r.images_per_s),
        ("boot (start to first claim), ms", lambda r: r.boot_s * 1000),
        ("drain (first claim to last finish), s", lambda r: r.drain_s),
        ("tail (last finish to exit), ms", lambda r: r.tail_s * 1000),
        ("load (1 min)", lambda r: r.load_1min),
    ]
    for label, value in timeline:
        rows.append([label, *(median(s, value) for s in sides)])
    return table(["", *sides], rows)


if __name__ == "__main__":
    main()
