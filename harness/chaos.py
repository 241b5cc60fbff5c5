"""Chaos run: derivd under fire loses nothing, commits nothing twice, leaks nothing.

    .venv/bin/python -m harness.chaos [--seed N] [--full] [--images N] [--backend vips]
                                      [--pipeline N] [--pooler]

Builds a throw-away world in a temp dir: an embedded PostgreSQL (TCP), moto's S3 server
behind a fault-injecting proxy, and the real `derivd run` (several prefork workers at
`[supervisor] pipeline` --pipeline, an 8 s lease, a 4 s job timeout).
Its backend is vips or Pillow through harness.derive_log, which logs every derive start
and makes some first attempts derive for 50-90 % of the job timeout. It queues a seeded
mix of valid and hostile images (tests/support/imagegen.py CASES, each with its expected end
state) in waves while it:

- switches the storage proxy between pass, 503s, connection resets (before and after
  the request reached S3) and slow responses;
- SIGKILLs random workers (found by their process titles `derivd: worker N ...`), and
  workers deriving while another job waits behind theirs;
- terminates a worker's database connection in the middle of a commit
  (`pg_terminate_backend` of a backend named `derivd-worker-...`, caught blocked on a
  row lock the run holds): the commit's answer is lost, the commit is not;
- freezes a worker in the middle of a job (SIGSTOP, with the supervisor frozen too, so
  nothing kills it) until its lease expired and another worker took the job over, then
  thaws it: its late commit or failure must be fenced out (a `lease_lost` event);
- restarts PostgreSQL once;
- SIGKILLs the supervisor's webhook deliverer twice and restarts the webhook receiver
  (a process verifying with `standardwebhooks`) once (harness/chaos_webhooks.py).

Then the faults stop, the queue drains, the supervisor is stopped with SIGTERM, one
`derivd sweep --orphan-guard 0` runs (safe then: no attempt is live), and the
invariants are checked and printed as a table: this run's own expectations, then every
invariant of the state machine over the history it left (harness.invariants: events,
tables, the bucket's listing, the derive log, the kills and the outage it caused). The
exit status is 1 when any fails.
The same --seed gives the same inputs and the same schedule of faults (what the
processes make of it still depends on timing).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.chaos_checks import Check, check_all
from harness.chaos_faults import FULL, SHORT, drain, run_chaos
from harness.chaos_webhooks import wait_delivered
from harness.chaos_world import SWEEP_BOUND_S, World, make_inputs, say
from harness.tables import table


def print_verdict(ok: bool, notes: list[str], log_path: Path) -> None:
    """A chaos run's last lines: its notes, the verdict, and on failure the log's tail."""
    for note in notes:
        print(f"note: {note}")
    print("RESULT: " + ("all invariants hold" if ok else "INVARIANT FAILED"))
    if not ok:
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        print("--- derivd log (last lines) ---\n" + "\n".join(tail))


def clean_up(root: Path, *, ok: bool, keep: bool) -> None:
    """A passing run's files go unless asked to keep them; a failing run's stay."""
    if ok and not keep:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"kept {root}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    parser.add_argument("--full", action="store_true", help=f"the long run ({FULL.images} images)")
    parser.add_argument("--images", type=int, help="override the number of images")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--backend", default="vips", choices=["vips", "pillow"])
    parser.add_argument("--claim-batch", type=int, default=1, help="[queue] claim_batch")
    parser.add_argument("--pipeline", type=int, default=2, help="[supervisor] pipeline")
    parser.add_argument(
        "--pooler", action="store_true", help="derivd through PgBouncer (transaction mode)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (kept on failure)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    plan = FULL if args.full else SHORT
    if args.images:
        plan = dataclasses.replace(plan, images=args.images)
    rng = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="derivd-chaos-"))
    root.chmod(0o711)  # the embedded server may run as `postgres`: it must traverse
    say(
        f"chaos seed={seed} images={plan.images} workers={args.workers} backend={args.backend} "
        f"claim_batch={args.claim_batch} pipeline={args.pipeline} "
        f"pooler={'yes' if args.pooler else 'no'} chaos={plan.chaos_s:g}s in {root}"
    )
    world = World(
        root, seed, args.backend, args.workers, args.claim_batch, args.pooler, args.pipeline
    )
    ok = False
    try:
        inputs = make_inputs(rng, plan.images)
        world.start()
        world.run_supervisor()
        expected, tally = run_chaos(world, plan, rng, inputs)
        say(f"chaos over; draining {len(expected)} rows")
        drained = drain(world, plan.drain_s)
        if not drained:
            tally.notes.append(f"not drained within {plan.drain_s:g}s")
        if not wait_delivered(world.query, plan.drain_s):
            tally.notes.append(f"webhooks not delivered within {plan.drain_s:g}s")
        exit_code: int | None = None
        if world.supervisor_alive():
            world.supervisor.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            try:
                exit_code = world.supervisor.wait(60)  # type: ignore[union-attr]
            except subprocess.TimeoutExpired:
                tally.notes.append("supervisor did not stop within 60s of SIGTERM")
        else:
            tally.supervisor_died = True
            exit_code = world.supervisor.returncode if world.supervisor else None
        sweep = world.cli(
            "sweep", "--orphan-guard", "0", "--delete-guard", "0", timeout=SWEEP_BOUND_S
        )
        say(f"sweep (exit {sweep.returncode}): {sweep.stdout.strip().splitlines()[-1:]}")
        checks = check_all(world, expected, tally, exit_code)
        last = (sweep.stdout.strip().splitlines() or ["(no output)"])[-1]
        checks.insert(0, Check("sweep ran (orphan guard 0)", sweep.returncode == 0, last))
        ok = all(c.ok for c in checks)
        counters = world.proxy.snapshot() if world.proxy else {}
        print()
        print(
            table(
                ["invariant", "result", "detail"],
                [(c.name, "PASS" if c.ok else "FAIL", c.detail) for c in checks],
            )
        )
        print()
        print(
            f"seed {seed}: {len(expected)} images, {tally.kills} worker kills "
            f"({tally.waiting_kills} with a job waiting), {tally.terminations} commit(s) "
            f"cut off, {tally.stunts} freeze(s) past the lease, {tally.pg_restarts} PostgreSQL "
            f"restart(s), fault switches {dict(tally.fault_switches)}"
        )
        print("proxy: " + ", ".join(f"{k}={v}" for k, v in sorted(counters.items())))
        print_verdict(ok, tally.notes, world.log_path)
    finally:
        world.close()
        clean_up(root, ok=ok, keep=args.keep)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
