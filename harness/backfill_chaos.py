"""Backfill chaos: a backfill runs while workers die, tenants are capped and an operator
deletes and retries files; afterwards every ready file holds exactly the new variant
set and every invariant of the state machine holds over the whole history.

    .venv/bin/python -m harness.backfill_chaos [--seed N] [--images N] [--pooler]
                                               [--pipeline N]

Builds the world of harness/chaos_world.py (embedded PostgreSQL over TCP, moto's S3 behind
the fault proxy, the derive log, the real `derivd run` with 3 workers at `[supervisor]
pipeline` --pipeline, a 15 s lease, 10 s job timeout, a few first derives stretched to
50-90 % of it) with
`[queue] max_in_flight_per_tenant = 1` and the inputs spread over three tenants and no
tenant. Then:

1. a first half of the inputs is derived with the variants `preview, thumb`;
2. the configuration gains a third variant (`card`, a 160x160 crop) and the supervisor
   reloads it (SIGHUP), replacing every worker;
3. `derivd backfill --apply --max-queued 6` runs while the second half is uploaded in
   waves, random workers are SIGKILLed (busy ones first; one while a job waits behind
   a running one), workers' connections are terminated in commits, the storage proxy switches
   between pass, 503s, resets and slow answers, and an operator runs `derivd delete` on
   ready files (some of them with a re-derivation under way) and on new uploads, and
   `derivd retry --rejected`.

Then the faults stop, the queue drains, the supervisor gets SIGTERM, one sweep runs with
guards 0, and the checks are printed: each input's outcome (valid: ready, or deleted if
the operator deleted it; hostile: its content code, or deleted), the backfill's exit,
the bytes of every ready variant, and the history checker (harness.invariants) under
the final configuration. The exit status is 1 when any fails.
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import dataclasses
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from derivd.config_load import load_config
from derivd.osproc import pid_alive
from derivd.processes.duties import variant_set_of
from derivd.queue.db import QueueDB
from derivd.storage.base import new_original_key
from harness import chaos, chaos_checks, chaos_faults, chaos_world
from harness.chaos_checks import Check
from harness.chaos_faults import Tally
from harness.chaos_world import World, say
from harness.tables import table

TENANTS: tuple[str | None, ...] = ("acme", "globex", "initech", None)
TENANT_CAP = 1
BEFORE = "preview:320, thumb:64"
AFTER = "preview:320, thumb:64, card"
CARD = {"size": "160x160", "fit": "cover"}
MAX_QUEUED = 6
LEASE_S = 15.0
JOB_TIMEOUT_S = 10.0
# Of the inputs, the share whose first derive is stretched (harness/chaos_world.py's is more:
# here each one is 5-9 s).
SLOW_SHARE = 0.08


@dataclasses.dataclass(frozen=True)
class Plan:
    images: int
    waves: int
    chaos_s: float
    kills: int
    deletes: int
    drain_s: float
    terminations: int = 3  # worker connections terminated in a commit
    waiting_kills: int = 1  # workers killed while a job waits behind theirs


SHORT = Plan(images=80, waves=5, chaos_s=30.0, kills=3, deletes=4, drain_s=240.0)


@dataclasses.dataclass
class Operator:
    """What the operator did: the ids it deleted, how often it retried."""

    deleted: set[int] = dataclasses.field(default_factory=set)
    retries: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)

    def delete(self, world: World, ids: list[int]) -> None:
        if not ids:
            return
        run = world.cli("delete", *map(str, ids))
        if run.returncode != 0:
            self.failures.append(f"delete {ids}: exit {run.returncode} {run.stderr[-200:]}")
            return
        self.deleted.update(ids)
        say(f"operator: derivd delete {' '.join(map(str, ids))}")

    def retry(self, world: World) -> None:
        run = world.cli("retry", "--rejected")
        if run.returncode != 0:
            self.failures.append(f"retry --rejected: exit {run.returncode} {run.stderr[-200:]}")
            return
        self.retries += 1
        say(f"operator: derivd retry --rejected ({run.stdout.strip().splitlines()[-1:]})")


def configure(world: World, variants: str) -> None:
    """The chaos world's INI with the tenant cap and `variants` (the card's section)."""
    ini = configparser.ConfigParser()
    ini.read(world.ini)
    ini["queue"]["max_in_flight_per_tenant"] = str(TENANT_CAP)
    # Nothing here needs chaos.py's short job timeout (its freeze does): at a load of 30
    # on 2 cores a valid image timed out 8 times running and ended resource_limit.
    ini["queue"]["lease"] = str(LEASE_S)
    ini["supervisor"]["job_timeout"] = str(JOB_TIMEOUT_S)
    world.job_timeout = JOB_TIMEOUT_S
    world.slow_share = SLOW_SHARE
    ini["sweep"]["orphan_guard"] = str(LEASE_S + 1)
    ini["derive"]["variants"] = variants
    if "card" in variants:
        ini["variant:card"] = CARD
    with world.ini.open("w") as out:
        ini.write(out)


def enqueue(
    world: World, inputs: list[tuple[str, str, bytes]], rng: random.Random
) -> dict[int, tuple[str, str]]:
    """Upload straight to moto, then queue each input under a seeded tenant."""
    client = world.s3()
    groups: dict[str | None, list[tuple[str, str, tuple[str, str]]]] = {}
    for name, expected, data in inputs:
        key = new_original_key()
        version = client.put_object(Bucket=world.bucket, Key=key, Body=data)["VersionId"]
        groups.setdefault(rng.choice(TENANTS), []).append((name, expected, (key, version)))
    world.stretch([key for items in groups.values() for _, _, (key, _) in items])
    out: dict[int, tuple[str, str]] = {}
    deadline = time.monotonic() + 60
    for tenant, items in groups.items():
        while True:
            try:
                with QueueDB.open(world.dsn, role="chaos") as queue:
                    ids = queue.enqueue([o for _, _, o in items], tenant=tenant)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        out.update({i: (n, e) for i, (n, e, _) in zip(ids, items, strict=True)})
    return out


def reload_variants(world: World, tally: Tally) -> None:
    """Write the new variant set and SIGHUP the supervisor; wait until every worker it
    had is gone (each replacement starts with the new set)."""
    old = set(chaos_world.workers(world.sup_pid))
    configure(world, AFTER)
    world.supervisor.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    deadline = time.monotonic() + 90
    while any(pid_alive(p) and p in chaos_world.workers(world.sup_pid) for p in old):
        if time.monotonic() > deadline:
            tally.notes.append("reload: old workers still running after 90 s")
            break
        time.sleep(0.1)
    # `backfill --apply` refuses while a live host derives another set: the host
    # registry learns the new one with the supervisor's next heartbeat.
    target = variant_set_of(load_config(world.ini))
    while world.query(
        "SELECT 1 FROM derivd_hosts WHERE variant_set IS DISTINCT FROM %s", (target,)
    ):
        if time.monotonic() > deadline:
            tally.notes.append("reload: the host registry still names the old set after 90 s")
            break
        time.sleep(0.1)
    say(f"reloaded: variants {AFTER!r}; workers {sorted(chaos_world.workers(world.sup_pid))}")


def ready_ids(world: World, among: set[int]) -> tuple[list[int], list[int]]:
    """Ready files among `among`: (with a live re-derivation, without one)."""
    rows = world.query(
        "SELECT f.id, EXISTS (" + _live_rederivation(world) + ") FROM archive_files AS f"
        " WHERE f.status = 'ready' AND f.id = ANY(%s)",
        (sorted(among),),
    )
    return [r[0] for r in rows if r[1]], [r[0] for r in rows if not r[1]]


def _live_rederivation(world: World) -> str:
    """A live re-derivation of file `f`: a job row of archive_files, or of its own table."""
    table = world.query("SELECT to_regclass('derivd_rederivations') IS NOT NULL")[0][0]
    if table:
        return "SELECT 1 FROM derivd_rederivations AS j WHERE j.file_id = f.id" + _LIVE
    return "SELECT 1 FROM archive_files AS j WHERE j.rederive_of = f.id" + _LIVE


_LIVE = " AND j.status IN ('queued', 'processing')"


def drain(world: World, timeout: float) -> bool:
    """Wait until nothing is queued or processing, files and re-derivations alike
    (deletions finish in the final sweep, whose guard is 0)."""
    jobs = world.query("SELECT to_regclass('derivd_rederivations') IS NOT NULL")[0][0]
    query = "SELECT count(*) FROM archive_files WHERE status IN ('queued', 'processing')"
    if jobs:
        query += (
            " UNION ALL SELECT count(*) FROM derivd_rederivations"
            " WHERE status IN ('queued', 'processing')"
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(r[0] for r in world.query(query)) == 0:
            return True
        if not world.supervisor_alive():
            return False
        time.sleep(0.5)
    return False


def run(
    world: World, plan: Plan, rng: random.Random, tally: Tally, operator: Operator
) -> tuple[dict[int, tuple[str, str]], int | None]:
    # Most valid inputs go first: the backfill needs ready files to re-derive.
    inputs = chaos_world.make_inputs(rng, plan.images)
    valid = [i for i in inputs if i[1] == "ready"]
    hostile = [i for i in inputs if i[1] != "ready"]
    cut_valid, cut_hostile = 2 * len(valid) // 3, len(hostile) // 3
    first = valid[:cut_valid] + hostile[:cut_hostile]
    second = valid[cut_valid:] + hostile[cut_hostile:]
    rng.shuffle(second)
    expected = enqueue(world, first, rng)
    say(f"phase 1: {len(expected)} files with {BEFORE!r}")
    if not drain(world, plan.drain_s):
        tally.notes.append("phase 1 did not drain")
    reload_variants(world, tally)
    backfill = subprocess.Popen(
        [str(chaos_world.DERIVD), "-c", str(world.ini), "backfill", "--apply",
         "--max-queued", str(MAX_QUEUED)],
        env=world.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    say(f"phase 2: derivd backfill --apply --max-queued {MAX_QUEUED} (pid {backfill.pid})")
    old_files = set(expected)
    waves = [second[i :: plan.waves] for i in range(plan.waves)]
    span = plan.chaos_s
    schedule = [(i * span / plan.waves, "wave") for i in range(plan.waves)]
    schedule += [(rng.uniform(0.05, 0.9) * span, "kill") for _ in range(plan.kills)]
    schedule += [(rng.uniform(0.1, 0.8) * span, "delete") for _ in range(plan.deletes)]
    schedule += [(0.3 * span, "retry"), (0.7 * span, "retry")]
    schedule += [(t, "faults") for t in chaos_faults.ticks(rng, span, 3.0)]
    schedule += [(rng.uniform(0.1, 0.9) * span, "terminate") for _ in range(plan.terminations)]
    schedule += [(rng.uniform(0.2, 0.9) * span, "kill_waiting") for _ in range(plan.waiting_kills)]
    schedule.sort()
    mischief = chaos_faults.Chaos(world, rng, tally)
    started = time.monotonic()
    for at, action in schedule:
        time.sleep(max(0.0, started + at - time.monotonic()))
        if not world.supervisor_alive():
            tally.supervisor_died = True
            break
        if action == "wave" and waves:
            expected.update(enqueue(world, waves.pop(0), rng))
        elif action == "kill":
            mischief.kill_worker()
        elif action == "kill_waiting":
            mischief.kill_with_one_waiting()
        elif action == "terminate":
            mischief.terminate_in_commit()
        elif action == "faults":
            mischief.switch_faults()
        elif action == "retry":
            operator.retry(world)
        elif action == "delete":
            busy, idle = ready_ids(world, old_files - operator.deleted)
            new = sorted(set(expected) - old_files - operator.deleted)
            picks = busy[:1] + rng.sample(idle, min(1, len(idle)))
            picks += rng.sample(new, min(1, len(new)))
            operator.delete(world, picks)
    while waves:
        expected.update(enqueue(world, waves.pop(0), rng))
    assert world.proxy is not None
    world.proxy.pass_through()
    try:
        out, _ = backfill.communicate(timeout=plan.drain_s)
        say(f"backfill exit {backfill.returncode}: {out.strip().splitlines()[-1:]}")
    except subprocess.TimeoutExpired:
        backfill.kill()
        tally.notes.append("backfill did not finish")
    return expected, backfill.returncode


def outcome_checks(
    world: World,
    expected: dict[int, tuple[str, str]],
    operator: Operator,
    backfill_exit: int | None,
) -> list[Check]:
    rows = {r[0]: r for r in world.query("SELECT id, status, error_code FROM archive_files")}
    wrong = []
    for file_id, (case, want) in expected.items():
        row = rows.get(file_id)
        got = None if row is None else (row[1] if row[1] in ("ready", "deleted") else row[2])
        wanted = {"deleted"} if file_id in operator.deleted else {want}
        if got not in wanted:
            wrong.append(f"{file_id}:{case} want {wanted} got {got}")
    kinds = dict(world.query("SELECT kind, count(*) FROM archive_events GROUP BY kind"))
    return [
        Check(
            "valid -> ready, hostile -> its code, deleted -> deleted",
            not wrong,
            f"{len(expected)} files, {len(operator.deleted)} deleted; wrong: {wrong[:6]}",
        ),
        Check("backfill --apply exit 0", backfill_exit == 0, f"exit {backfill_exit}"),
        Check(
            "the run did its tricks (re-derived, deleted, retried)",
            kinds.get("rederived", 0) > 0
            and bool(operator.deleted)
            and operator.retries > 0
            and not operator.failures,
            f"rederived={kinds.get('rederived', 0)}, deleted={len(operator.deleted)}, "
            f"retries={operator.retries}, operator failures: {operator.failures[:3]}",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    parser.add_argument("--images", type=int, help=f"default {SHORT.images}")
    parser.add_argument("--backend", default="vips", choices=["vips", "pillow"])
    parser.add_argument("--pipeline", type=int, default=2, help="[supervisor] pipeline")
    parser.add_argument(
        "--pooler", action="store_true", help="derivd through PgBouncer (transaction mode)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (kept on failure)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    plan = dataclasses.replace(SHORT, images=args.images) if args.images else SHORT
    rng = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="derivd-backfill-chaos-"))
    root.chmod(0o711)  # the embedded server may run as `postgres`: it must traverse
    say(
        f"backfill chaos seed={seed} images={plan.images} cap={TENANT_CAP} "
        f"pipeline={args.pipeline} pooler={'yes' if args.pooler else 'no'} in {root}"
    )
    world = World(root, seed, args.backend, 3, pooler=args.pooler, pipeline=args.pipeline)
    ok = False
    try:
        world.start()
        configure(world, BEFORE)
        world.run_supervisor()
        tally, operator = Tally(), Operator()
        expected, backfill_exit = run(world, plan, rng, tally, operator)
        say(f"chaos over; draining {len(expected)} files")
        if not drain(world, plan.drain_s):
            tally.notes.append(f"not drained within {plan.drain_s:g}s")
        exit_code: int | None = None
        if world.supervisor_alive():
            world.supervisor.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            with contextlib.suppress(subprocess.TimeoutExpired):
                exit_code = world.supervisor.wait(60)  # type: ignore[union-attr]
        sweep = world.cli(
            "sweep", "--orphan-guard", "0", "--delete-guard", "0", timeout=chaos_world.SWEEP_BOUND_S
        )
        last = (sweep.stdout.strip().splitlines() or ["(no output)"])[-1]
        checks = [Check("sweep ran (guards 0)", sweep.returncode == 0, last)]
        checks += outcome_checks(world, expected, operator, backfill_exit)
        checks.append(chaos_checks.check_variant_bytes(world))
        checks.append(
            Check(
                "supervisor survived, exit 0 after SIGTERM",
                not tally.supervisor_died and exit_code == 0,
                f"exit code {exit_code}",
            )
        )
        checks += chaos_checks.history_checks(world, tally)
        ok = all(c.ok for c in checks)
        print()
        print(
            table(
                ["invariant", "result", "detail"],
                [(c.name, "PASS" if c.ok else "FAIL", c.detail) for c in checks],
            )
        )
        print(f"\nseed {seed}: {len(expected)} files, {tally.kills} worker kills, "
              f"{len(operator.deleted)} deleted, {operator.retries} retries, "
              f"fault switches {dict(tally.fault_switches)}")  # fmt: skip
        chaos.print_verdict(ok, tally.notes, world.log_path)
    finally:
        world.close()
        chaos.clean_up(root, ok=ok, keep=args.keep)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
