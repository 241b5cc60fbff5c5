"""Fleet chaos: three supervisors on one PostgreSQL and one S3 lose nothing when hosts die.

    .venv/bin/python -m harness.fleet_chaos [--seed N] [--full] [--images N] [--pipeline N]
                                            [--direct]

Builds the world of harness/chaos_world.py (embedded PostgreSQL over TCP, moto's S3 behind
the fault proxy, the derive log) and runs three `derivd run` (host ids h1, h2, h3; own state
dirs; 2 workers each at `[supervisor] pipeline` --pipeline) on it, through PgBouncer in
transaction mode (--direct: without), with an 8 s lease. While a seeded mix of valid and
hostile images is queued in waves it:

- kills host h1: SIGKILL to its supervisor and every process under it ("host death"),
  then measures, for every job h1 held, how long until another host claimed it again
  (bound: lease + poll_interval + 1 s) and watches `derivd status --json` show h1 as not
  alive, then pruned;
- pauses host h2 (SIGSTOP to its supervisor and workers, caught in the middle of jobs)
  until the other hosts took its jobs over, then resumes it: its heartbeat (or deadline)
  must find the loss, and its late writes must be fenced (`lease_lost`);
- restarts PostgreSQL once;
- terminates workers' server connections in the middle of commits, and SIGKILLs one of
  h3's workers while a job waits behind a running one (harness/chaos_faults.py).

Then the queue drains, h2 and h3 get SIGTERM, one sweep runs, and the checks of
harness/chaos_checks.py run plus the failover bound and the registry's view of the dead
host. The exit status is 1 when any fails.
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import dataclasses
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from derivd.osproc import children_of
from harness import chaos, chaos_checks, chaos_faults, chaos_world
from harness.chaos_checks import Check
from harness.chaos_faults import Tally
from harness.chaos_webhooks import wait_delivered
from harness.chaos_world import World, say
from harness.tables import table

HOSTS = ("h1", "h2", "h3")
POLL_S = 0.5
FAILOVER_BOUND_S = chaos_world.LEASE_S + POLL_S + 1.0
PRUNE_GUARD_S = 40.0  # [sweep] orphan_guard: how long a dead host's row stays, stale
STATS_S = 2.0  # [metrics] interval: the registry is pruned on this timer


@dataclasses.dataclass(frozen=True)
class Plan:
    images: int
    waves: int
    chaos_s: float
    drain_s: float
    terminations: int  # worker connections terminated in a commit
    waiting_kills: int  # h3's workers killed while a job waits behind theirs


SHORT = Plan(images=300, waves=10, chaos_s=45.0, drain_s=240.0, terminations=3, waiting_kills=1)
FULL = Plan(images=900, waves=30, chaos_s=120.0, drain_s=600.0, terminations=10, waiting_kills=4)


@dataclasses.dataclass
class Failover:
    """Host death: what the dead host held and when each job was claimed again."""

    killed_at: float = 0.0
    held: dict[int, str] = dataclasses.field(default_factory=dict)  # id -> token
    reclaimed: dict[int, float] = dataclasses.field(default_factory=dict)  # id -> seconds
    stale_seen_s: float | None = None
    pruned_seen_s: float | None = None


class Fleet:
    def __init__(self, world: World) -> None:
        self.world = world
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.status_errors: list[str] = []

    def configure(self) -> None:
        """The chaos world's INI, with the fleet's registry timers."""
        ini = configparser.ConfigParser()
        ini.read(self.world.ini)
        ini["queue"]["poll_interval"] = str(POLL_S)
        ini["sweep"]["orphan_guard"] = str(PRUNE_GUARD_S)
        ini["supervisor"]["workers"] = "2"
        ini["metrics"] = {"interval": str(STATS_S)}
        with self.world.ini.open("w") as out:
            ini.write(out)

    def start(self, name: str) -> None:
        env = dict(self.world.env)
        env["DERIVD_SUPERVISOR_HOST_ID"] = name
        env["DERIVD_SUPERVISOR_STATE_DIR"] = str(self.world.root / f"state-{name}")
        with (self.world.root / f"{name}.log").open("ab") as log:
            self.procs[name] = subprocess.Popen(
                [str(chaos_world.DERIVD), "-c", str(self.world.ini), "run"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )

    def tree(self, name: str) -> list[int]:
        pid = self.procs[name].pid
        return [pid, *children_of(pid)]

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def signal(self, name: str, sig: int, tally: Tally | None = None) -> None:
        """Signal host `name`'s every process; a SIGKILL goes on `tally`'s record."""
        for pid in self.tree(name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                if tally is not None and sig == signal.SIGKILL:
                    tally.killed.append((pid, time.time()))

    def held(self, name: str) -> dict[int, str]:
        rows = self.world.query(
            "SELECT id, lease_token::text FROM archive_files "
            "WHERE status = 'processing' AND claimed_by = %s",
            (name,),
        )
        return {int(r[0]): str(r[1]) for r in rows}

    def hosts(self) -> dict[str, dict[str, object]]:
        run = self.world.cli("status", "--json", timeout=60)
        try:
            return {h["host"]: h for h in json.loads(run.stdout).get("hosts", [])}
        except ValueError:
            self.status_errors.append(f"exit {run.returncode}: {run.stderr.strip()[-200:]}")
            return {}

    def stop_all(self) -> dict[str, int | None]:
        codes: dict[str, int | None] = {}
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = None
        return codes


def host_death(
    fleet: Fleet, failover: Failover, feed: Callable[[], None], tally: Tally
) -> list[threading.Thread]:
    """SIGKILL h1's whole tree; a thread then watches its jobs come back and the registry
    call it stale, then prune it."""
    # Slow storage keeps jobs running, so h1 dies holding some: a death that loses
    # nothing proves little.
    proxy = fleet.world.proxy
    assert proxy is not None
    proxy.slow(0.7, 1.0)
    feed()
    deadline = time.monotonic() + 20
    while not fleet.held("h1") and time.monotonic() < deadline:
        time.sleep(0.05)
    fleet.signal("h1", signal.SIGKILL, tally)
    proxy.pass_through()
    failover.killed_at = time.monotonic()
    fleet.procs["h1"].wait()
    failover.held = fleet.held("h1")
    say(f"host death: SIGKILL h1 and its workers; it held {sorted(failover.held)}")

    def reclaims() -> None:
        pending = dict(failover.held)
        while pending and time.monotonic() - failover.killed_at < 120:
            for file_id, token in list(pending.items()):
                rows = fleet.world.query(
                    "SELECT 1 FROM archive_files WHERE id = %s AND lease_token IS DISTINCT FROM %s"
                    " AND (status <> 'processing' OR claimed_by <> 'h1')",
                    (file_id, token),
                )
                if rows:
                    failover.reclaimed[file_id] = time.monotonic() - failover.killed_at
                    del pending[file_id]
            time.sleep(0.05)

    def registry() -> None:  # `derivd status` takes seconds on a loaded machine: poll apart
        while time.monotonic() - failover.killed_at < PRUNE_GUARD_S * 3:
            h1 = fleet.hosts().get("h1")
            now = time.monotonic() - failover.killed_at
            if h1 is not None and not h1["alive"] and failover.stale_seen_s is None:
                failover.stale_seen_s = now
            if h1 is None and failover.stale_seen_s is not None:
                failover.pruned_seen_s = now
                return
            time.sleep(0.5)

    threads = [threading.Thread(target=t, daemon=True) for t in (reclaims, registry)]
    for thread in threads:
        thread.start()
    return threads


def host_pause(fleet: Fleet, tally: Tally, feed: Callable[[], None]) -> None:
    """SIGSTOP h2's tree in the middle of jobs until other hosts took them over."""
    proxy = fleet.world.proxy
    assert proxy is not None
    proxy.slow(0.7, 1.0)  # jobs take long enough to be caught in the middle
    feed()
    deadline, held = time.monotonic() + 20, {}
    while time.monotonic() < deadline:
        fleet.signal("h2", signal.SIGSTOP)
        held = fleet.held("h2")
        if held:
            break
        fleet.signal("h2", signal.SIGCONT)
        time.sleep(0.1)
    proxy.pass_through()
    if not held:
        tally.notes.append("pause: h2 was never caught holding a job")
        fleet.signal("h2", signal.SIGCONT)
        return
    say(f"host pause: SIGSTOP h2 holding {sorted(held)}")
    deadline = time.monotonic() + chaos_world.LEASE_S * 8
    while time.monotonic() < deadline:
        moved = [
            i
            for i, tok in held.items()
            if fleet.world.query(
                "SELECT 1 FROM archive_files WHERE id = %s AND lease_token IS DISTINCT FROM %s",
                (i, tok),
            )
        ]
        if len(moved) == len(held):
            break
        time.sleep(0.2)
    else:
        tally.notes.append("pause: not every job of h2 was taken over")
    fleet.signal("h2", signal.SIGCONT)
    tally.stunts += 1
    tally.stunt_tokens += list(held.values())
    say(f"host pause: SIGCONT h2 after its jobs moved on (lease {chaos_world.LEASE_S:g}s)")


def run(
    fleet: Fleet, plan: Plan, rng: random.Random, tally: Tally
) -> tuple[dict[int, tuple[str, str]], Failover]:
    world = fleet.world
    inputs = chaos_world.make_inputs(rng, plan.images)
    waves = [inputs[i :: plan.waves + 1] for i in range(plan.waves + 1)]
    expected: dict[int, tuple[str, str]] = {}

    def feed() -> None:
        if waves:
            expected.update(world.enqueue(waves.pop(0)))

    failover = Failover()
    span = plan.chaos_s
    schedule = [(i * span / plan.waves, "wave") for i in range(plan.waves)]
    schedule += [(0.25 * span, "death"), (0.5 * span, "pause"), (0.75 * span, "pg_restart")]
    schedule += [(rng.uniform(0.1, 0.9) * span, "terminate") for _ in range(plan.terminations)]
    schedule += [(rng.uniform(0.3, 0.9) * span, "kill_waiting") for _ in range(plan.waiting_kills)]
    schedule.sort()
    mischief = chaos_faults.Chaos(world, rng, tally)
    watchers: list[threading.Thread] = []
    started = time.monotonic()
    for at, action in schedule:
        time.sleep(max(0.0, started + at - time.monotonic()))
        if action == "wave":
            feed()
        elif action == "death":
            watchers = host_death(fleet, failover, feed, tally)
        elif action == "pause":
            host_pause(fleet, tally, feed)
        elif action == "pg_restart":
            mischief.restart_postgres()
        elif action == "terminate":
            mischief.terminate_in_commit()
        elif action == "kill_waiting":
            mischief.kill_with_one_waiting(fleet.procs["h3"].pid, "h3", feed)
    while waves:
        feed()
    for watcher in watchers:
        watcher.join(PRUNE_GUARD_S * 3 + 130)
    return expected, failover


def failover_checks(failover: Failover) -> list[Check]:
    times = sorted(failover.reclaimed.values())
    missing = sorted(set(failover.held) - set(failover.reclaimed))
    late = [t for t in times if t > FAILOVER_BOUND_S]
    detail = (
        f"{len(failover.held)} jobs; reclaimed after "
        + (f"p50 {statistics.median(times):.1f}s max {max(times):.1f}s" if times else "-")
        + f" (bound {FAILOVER_BOUND_S:g}s); never: {missing}"
    )
    print("failover (host SIGKILL -> claimed again), s: " + ", ".join(f"{t:.2f}" for t in times))
    return [
        Check(
            "dead host's jobs claimed again within lease + poll + 1 s",
            bool(failover.held) and not missing and not late,
            detail,
        ),
        Check(
            "status shows the dead host not alive, then pruned",
            failover.stale_seen_s is not None and failover.pruned_seen_s is not None,
            f"stale seen {failover.stale_seen_s}s, pruned seen {failover.pruned_seen_s}s after "
            f"the kill (guard {PRUNE_GUARD_S:g}s)",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    parser.add_argument("--full", action="store_true", help=f"the long run ({FULL.images} images)")
    parser.add_argument("--images", type=int, help="override the number of images")
    parser.add_argument("--backend", default="vips", choices=["vips", "pillow"])
    parser.add_argument("--pipeline", type=int, default=2, help="[supervisor] pipeline")
    parser.add_argument(
        "--direct", action="store_true", help="derivd straight to PostgreSQL, not through PgBouncer"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (kept on failure)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    plan = FULL if args.full else SHORT
    if args.images:
        plan = dataclasses.replace(plan, images=args.images)
    rng = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="derivd-fleet-"))
    root.chmod(0o711)
    say(
        f"fleet chaos seed={seed} images={plan.images} hosts={len(HOSTS)}x2 "
        f"pipeline={args.pipeline} pooler={'no' if args.direct else 'yes'} in {root}"
    )
    world = World(root, seed, args.backend, 2, pooler=not args.direct, pipeline=args.pipeline)
    fleet = Fleet(world)
    ok = False
    try:
        world.start()
        fleet.configure()
        for name in HOSTS:
            fleet.start(name)
        tally = Tally()
        expected, failover = run(fleet, plan, rng, tally)
        say(f"chaos over; draining {len(expected)} rows")
        deadline = time.monotonic() + plan.drain_s
        while time.monotonic() < deadline and world.query(
            "SELECT 1 FROM archive_files WHERE status NOT IN ('ready', 'rejected') LIMIT 1"
        ):
            time.sleep(0.5)
        tally.supervisor_died = not (fleet.alive("h2") and fleet.alive("h3"))
        # The surviving hosts' deliverers finish the webhooks (chaos_checks.check_all checks them).
        if not wait_delivered(world.query, plan.drain_s):
            tally.notes.append(f"webhooks not delivered within {plan.drain_s:g}s")
        codes = fleet.stop_all()
        survivors_ok = codes.get("h2") == 0 and codes.get("h3") == 0
        sweep = world.cli(
            "sweep", "--orphan-guard", "0", "--delete-guard", "0", timeout=chaos_world.SWEEP_BOUND_S
        )
        checks = chaos_checks.check_all(
            world, expected, tally, 0 if survivors_ok else codes.get("h3")
        )
        last = (sweep.stdout.strip().splitlines() or ["(no output)"])[-1]
        checks.insert(0, Check("sweep ran (orphan guard 0)", sweep.returncode == 0, last))
        checks += failover_checks(failover)
        if fleet.status_errors:
            tally.notes.append(f"derivd status failed: {fleet.status_errors[-3:]}")
        ok = all(c.ok for c in checks)
        print()
        print(
            table(
                ["invariant", "result", "detail"],
                [(c.name, "PASS" if c.ok else "FAIL", c.detail) for c in checks],
            )
        )
        print(f"\nseed {seed}: {len(expected)} images; exit codes {codes}")
        for note in tally.notes:
            print(f"note: {note}")
        print("RESULT: " + ("all invariants hold" if ok else "INVARIANT FAILED"))
        if not ok:
            for name in HOSTS:
                tail = (root / f"{name}.log").read_text(errors="replace").splitlines()[-25:]
                print(f"--- {name} log (last lines) ---\n" + "\n".join(tail))
    finally:
        for name in fleet.procs:
            with contextlib.suppress(Exception):
                fleet.signal(name, signal.SIGCONT)
                fleet.procs[name].kill()
        world.close()
        chaos.clean_up(root, ok=ok, keep=args.keep)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
