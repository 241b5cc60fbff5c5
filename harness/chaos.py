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
import contextlib
import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

import imagegen
from fixtures.faultproxy import FaultProxy
from fixtures.pgbouncer import PgBouncer
from fixtures.s3 import (
    AWS_ENV_UNSET,
    TEST_ACCESS_KEY,
    TEST_REGION,
    TEST_SECRET_KEY,
    MotoServer,
    aws_test_env,
)

from derivd.config_load import load_config
from derivd.embedded.pgcluster import EmbeddedCluster
from derivd.osproc import children_of
from derivd.queue.db import QueueDB, migrate
from derivd.storage.base import new_original_key
from harness import derive_log
from harness.chaos_webhooks import Hooks, wait_delivered
from harness.chaos_webhooks import checks as webhook_checks
from harness.history import Disruptions
from harness.history import load as load_history
from harness.invariants import Rules, unrecorded_deaths
from harness.invariants import check as check_history
from harness.listing import s3_objects
from harness.tables import table

ROOT = Path(__file__).resolve().parent.parent
DERIVD = Path(sys.executable).parent / "derivd"
LEASE_S = 8.0
JOB_TIMEOUT_S = 4.0
MAX_ATTEMPTS = 8
# The final sweep removes every orphan prefix through moto, one listing each: minutes on
# a loaded machine. A bound on a hang, not a timing.
SWEEP_BOUND_S = 600.0
CONTENT_CODES = {"corrupt_content", "unsupported_content", "resource_limit"}


@dataclasses.dataclass(frozen=True)
class Plan:
    images: int
    waves: int
    chaos_s: float
    kills: int
    stunts: int
    drain_s: float
    terminations: int  # worker connections terminated in a commit
    waiting_kills: int  # workers killed while a job waits behind theirs


SHORT = Plan(images=80, waves=8, chaos_s=24.0, kills=2, stunts=1, drain_s=150.0,
             terminations=3, waiting_kills=1)  # fmt: skip
FULL = Plan(images=360, waves=30, chaos_s=90.0, kills=8, stunts=2, drain_s=300.0,
            terminations=10, waiting_kills=4)  # fmt: skip
# Of every input, the share whose first attempt derives for 50-90 % of the job timeout
# (harness.derive_log): jobs near their deadline, with others waiting behind them.
SLOW_SHARE = 0.15
SLOW_SPAN = (0.5, 0.9)


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


# --------------------------------------------------------------------------- inputs


def make_inputs(rng: random.Random, count: int) -> list[tuple[str, str, bytes]]:
    """(case, expected, bytes) for `count` rows: about two thirds valid, the rest hostile,
    every hostile case at least once."""
    cache: dict[str, bytes] = {}

    def data(name: str, make: Callable[[], bytes]) -> bytes:
        if name == "random_bytes":  # seeded, unlike the generator's os.urandom
            return b"\x00rnd" + rng.randbytes(4092)
        if name not in cache:
            cache[name] = make()
        return cache[name]

    valid = [(n, m, e) for n, m, e in imagegen.CASES if e == "ready"]
    hostile = [(n, m, e) for n, m, e in imagegen.CASES if e != "ready"]
    picks = list(hostile)
    while len(picks) < count:
        picks.append(rng.choice(valid) if rng.random() < 0.7 else rng.choice(hostile))
    rng.shuffle(picks)
    return [(n, e, data(n, m)) for n, m, e in picks[:count]]


# --------------------------------------------------------------------------- processes


def title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


_ON_JOB = re.compile(r"^derivd: worker \d+ job (\d+)$")


def workers(supervisor_pid: int) -> dict[int, str]:
    """pid -> title of the supervisor's worker children."""
    out = {}
    for pid in children_of(supervisor_pid):
        text = title(pid)
        if text.startswith("derivd: worker"):
            out[pid] = text
    return out


def job_of(text: str) -> int | None:
    match = _ON_JOB.match(text)
    return int(match.group(1)) if match else None


# --------------------------------------------------------------------------- the world


class World:
    def __init__(
        self,
        root: Path,
        seed: int,
        backend: str,
        worker_count: int,
        claim_batch: int = 1,
        pooler: bool = False,
        pipeline: int = 2,
    ) -> None:
        self.root = root
        self.seed = seed
        self.backend = backend
        self.worker_count = worker_count
        self.claim_batch = claim_batch
        self.pipeline = pipeline
        self.job_timeout = JOB_TIMEOUT_S
        # Which inputs derive slowly: drawn apart from the schedule's generator, so a
        # seed's schedule stays what it was.
        self.slow_rng = random.Random(seed * 7919 + 1)
        self.slow: dict[str, float] = {}  # original key -> extra derive seconds
        self.slow_share = SLOW_SHARE
        self.derive_log = root / "derives.jsonl"
        self.slow_file = root / "slow-derives.json"
        self.pg = EmbeddedCluster(root / "pg" / "pgdata", listen_tcp=True, fast=True)
        self.pooler = pooler
        self.bouncer: PgBouncer | None = None
        self.moto = MotoServer(root / "moto.log")
        self.proxy: FaultProxy | None = None
        self.bucket = f"chaos-{uuid.uuid4().hex[:12]}"
        self.supervisor: subprocess.Popen[bytes] | None = None
        self.log_path = root / "derivd.log"
        self.ini = root / "derivd.ini"
        self.hooks = Hooks(root)
        self.env = dict(os.environ)
        for name in AWS_ENV_UNSET:
            self.env.pop(name, None)
        self.env.update(aws_test_env())
        # The workers import harness.derive_log, the backend that logs each derive start.
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
        )
        self.env[derive_log.LOG_ENV] = str(self.derive_log)
        self.env[derive_log.SLOW_ENV] = str(self.slow_file)
        os.environ.update(aws_test_env())  # the chaos script's own boto3 client
        for name in AWS_ENV_UNSET:
            os.environ.pop(name, None)

    @property
    def dsn(self) -> str:
        return self.pg.dsn()

    def s3(self) -> Any:
        """A client straight to moto (no faults): for uploads and the final checks."""
        return boto3.client(
            "s3",
            endpoint_url=self.moto.endpoint_url,
            region_name=TEST_REGION,
            aws_access_key_id=TEST_ACCESS_KEY,
            aws_secret_access_key=TEST_SECRET_KEY,
        )

    def start(self) -> None:
        (self.root / "pg").mkdir()
        (self.root / "pg").chmod(0o711)
        self.pg.start()
        if self.pooler:  # derivd (not the checks) goes through PgBouncer, transaction mode
            self.bouncer = PgBouncer(
                self.root / "pg" / "pgbouncer",
                pg_host="127.0.0.1",
                pg_port=self.pg.port,
                user="derivd",
            ).start()
        migrate(self.dsn)
        self.moto.start()
        client = self.s3()
        client.create_bucket(Bucket=self.bucket)
        client.put_bucket_versioning(
            Bucket=self.bucket, VersioningConfiguration={"Status": "Enabled"}
        )
        self.proxy = FaultProxy(("127.0.0.1", self.moto.port), seed=self.seed).start()
        self.hooks.start()
        self.write_ini()

    def write_ini(self) -> None:
        assert self.proxy is not None
        sections = {
            "database": (
                {"dsn": self.bouncer.dsn(self.dsn), "listen_dsn": self.dsn}
                if self.bouncer
                else {"dsn": self.dsn}
            ),
            "storage": {
                "backend": "s3",
                "bucket": self.bucket,
                "endpoint_url": self.proxy.url,
                "region": TEST_REGION,
            },
            "supervisor": {
                "workers": self.worker_count,
                "job_timeout": JOB_TIMEOUT_S,
                "kill_grace": 1,
                "shutdown_grace": 15,
                "state_dir": self.root / "state",
                "pipeline": self.pipeline,
            },
            "queue": {
                "lease": LEASE_S,
                "max_attempts": MAX_ATTEMPTS,
                "retry_base": 0.2,
                "retry_max": 2,
                "poll_interval": 0.5,
                "listen": "yes",
                "claim_batch": self.claim_batch,
            },
            "derive": {
                "backend": derive_log.backend_for(self.backend),
                "variants": "preview:320, thumb:64",
            },
            "sweep": {"orphan_guard": LEASE_S + 1},
            "logging": {"level": "info"},
            "webhook:chaos": self.hooks.section(),
        }
        self.ini.write_text(
            "".join(
                f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in values.items()) + "\n"
                for name, values in sections.items()
            )
        )

    def run_supervisor(self) -> None:
        with self.log_path.open("ab") as log:
            self.supervisor = subprocess.Popen(
                [str(DERIVD), "-c", str(self.ini), "run"],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )

    @property
    def sup_pid(self) -> int:
        assert self.supervisor is not None
        return self.supervisor.pid

    def supervisor_alive(self) -> bool:
        return self.supervisor is not None and self.supervisor.poll() is None

    def cli(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(DERIVD), "-c", str(self.ini), *args],
            env=self.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Read the tables (retrying through the PostgreSQL restart)."""
        deadline = time.monotonic() + 60
        while True:
            try:
                with psycopg.connect(self.dsn, connect_timeout=5) as conn:
                    return conn.execute(sql, params).fetchall()  # type: ignore[arg-type]
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def enqueue(self, inputs: list[tuple[str, str, bytes]]) -> dict[int, tuple[str, str]]:
        """Upload straight to moto (the upload API is not under test), then queue."""
        client = self.s3()
        originals = []
        for _, _, data in inputs:
            key = new_original_key()
            answer = client.put_object(Bucket=self.bucket, Key=key, Body=data)
            originals.append((key, answer["VersionId"]))
        self.stretch([key for key, _ in originals])
        deadline = time.monotonic() + 60
        while True:
            try:
                with QueueDB.open(self.dsn, role="chaos") as queue:
                    ids = queue.enqueue(originals)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        return {i: (name, expected) for i, (name, expected, _) in zip(ids, inputs, strict=True)}

    def reachable(self) -> float:
        """When derivd's DSN (PgBouncer's, with a pooler) answers a query (Unix time)."""
        dsn = self.bouncer.dsn(self.dsn) if self.bouncer else self.dsn
        deadline = time.monotonic() + 60
        while True:
            try:
                with psycopg.connect(dsn, connect_timeout=5) as conn:
                    conn.execute("SELECT 1")
                return time.time()
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    return time.time()
                time.sleep(0.1)

    def stretch(self, keys: list[str]) -> None:
        """Draw which of these originals' first derive takes 50-90 % of the job timeout,
        and tell the handler before they are queued."""
        for key in keys:
            if self.slow_rng.random() < self.slow_share:
                self.slow[key] = round(self.slow_rng.uniform(*SLOW_SPAN) * self.job_timeout, 2)
        part = self.slow_file.with_suffix(".part")
        part.write_text(json.dumps(self.slow))
        part.replace(self.slow_file)  # the handler never reads half a file

    def close(self) -> None:
        if self.supervisor is not None and self.supervisor.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.supervisor.pid, signal.SIGCONT)
            self.supervisor.kill()  # PR_SET_PDEATHSIG takes the workers along
            self.supervisor.wait()
        if self.proxy is not None:
            self.proxy.stop()
        self.hooks.stop()
        self.moto.stop()
        if self.bouncer is not None:
            self.bouncer.stop()
        with contextlib.suppress(Exception):
            self.pg.stop("immediate")


# --------------------------------------------------------------------------- chaos


@dataclasses.dataclass
class Tally:
    kills: int = 0
    # (job id, time.time()) of each worker killed in the middle of a job (its title's)
    busy_kills: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    stunts: int = 0
    stunt_tokens: list[str] = dataclasses.field(default_factory=list)
    pg_restarts: int = 0
    fault_switches: Counter[str] = dataclasses.field(default_factory=Counter)
    supervisor_died: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)
    # What the history checker is told the run did: every process SIGKILLed (pid, when)
    # and each span the database was away (start, end), Unix seconds.
    killed: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    outages: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    terminations: int = 0
    waiting_kills: int = 0

    def disruptions(self) -> Disruptions:
        return Disruptions(kills=tuple(self.killed), outages=tuple(self.outages))


# A worker whose commit was cut off sends it again at once (DESIGN.md "Pipelined
# worker"); cutting off that one too would be an outage of its own, not a lost answer.
RECUT_AFTER_S = 5.0


class Chaos:
    def __init__(self, world: World, rng: random.Random, tally: Tally) -> None:
        self.world = world
        self.rng = rng
        self.tally = tally
        self.cut_at: dict[str, float] = {}  # worker connection -> when its commit was cut

    def switch_faults(self) -> None:
        proxy = self.world.proxy
        assert proxy is not None
        mode = self.rng.choice(["pass", "error", "error", "reset", "reset_after", "slow"])
        if mode == "pass":
            proxy.pass_through()
        elif mode == "error":
            proxy.fail(
                self.rng.uniform(0.1, 0.35), self.rng.choice(["SlowDown", "ServiceUnavailable"])
            )
        elif mode == "reset":
            proxy.reset_connections(self.rng.uniform(0.05, 0.25))
        elif mode == "reset_after":
            proxy.reset_connections(self.rng.uniform(0.05, 0.2), after_upstream=True)
        else:
            proxy.slow(self.rng.uniform(0.2, 0.9), self.rng.uniform(0.1, 0.4))
        self.tally.fault_switches[mode] += 1

    def kill_worker(self) -> None:
        # Prefer a worker in the middle of a job (that is what loses work), waiting a
        # little for one; an idle one otherwise.
        deadline = time.monotonic() + 3.0
        while True:
            fleet = workers(self.world.sup_pid)
            busy = [pid for pid, text in fleet.items() if job_of(text) is not None]
            if busy or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        pool = sorted(busy or fleet)
        if not pool:
            self.tally.notes.append("kill: no worker found")
            return
        pid = self.rng.choice(pool)
        if self.sigkill(pid, fleet[pid]):
            say(f"SIGKILL worker pid {pid} ({fleet[pid]})")

    def sigkill(self, pid: int, text: str) -> bool:
        """SIGKILL worker `pid` (its title `text`, read a moment ago), on the record."""
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        now = time.time()
        self.tally.kills += 1
        self.tally.killed.append((pid, now))
        job = job_of(text)
        if job is not None:
            self.tally.busy_kills.append((job, now))
        return True

    def kill_with_one_waiting(
        self,
        supervisor: int | None = None,
        host: str | None = None,
        feed: Callable[[], None] | None = None,
    ) -> None:
        """SIGKILL a worker in the middle of a job while a job claimed on its host waits
        for its derive (held behind a running one: pipeline 2 and up; held = leased, its
        token not in the derive log); the held job must go back unburned, only the
        running one is charged. `supervisor` and `host`: the host's (default: the
        world's one supervisor). `feed` queues work first, so that jobs wait."""
        if feed is not None:
            feed()
        where = "" if host is None else " AND claimed_by = %s"
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline:
            fleet = workers(self.world.sup_pid if supervisor is None else supervisor)
            running = {pid: job_of(text) for pid, text in fleet.items() if job_of(text)}
            leased = self.world.query(
                "SELECT id, lease_token::text FROM archive_files WHERE status = 'processing'"
                + where,
                (host,) if host else (),
            )
            started = {s.token for s in derive_log.read(self.world.derive_log)}
            held = sorted(int(i) for i, token in leased if token not in started)
            if running and held:
                pid = self.rng.choice(sorted(running))
                if self.sigkill(pid, fleet[pid]):
                    self.tally.waiting_kills += 1
                    say(f"SIGKILL worker pid {pid} ({fleet[pid]}) while file(s) "
                        f"{held[:4]} wait behind running jobs")  # fmt: skip
                return
            time.sleep(0.05)
        self.tally.notes.append("kill: no job caught waiting behind a running one")

    def terminate_in_commit(self) -> None:
        """Lose a commit's answer: hold the lock of every leased row a moment, and when
        a worker's connection (application_name derivd-worker-...) blocks on it in a
        commit, terminate that backend (pg_terminate_backend), then let go. The commit
        never happened; the worker must send it again, not leave the row to its lease.
        Tries for a few seconds (rows must be leased, a worker must commit one)."""
        deadline = time.monotonic() + 8.0
        try:
            with (
                psycopg.connect(self.world.dsn, connect_timeout=5) as holder,
                psycopg.connect(self.world.dsn, autocommit=True, connect_timeout=5) as probe,
            ):
                while time.monotonic() < deadline:
                    victim = self._cut_one_commit(holder, probe)
                    holder.rollback()
                    if victim is not None:
                        self.tally.terminations += 1
                        say(f"terminated worker backend {victim} in a commit")
                        return
                    time.sleep(0.02)
        except psycopg.OperationalError as error:  # PostgreSQL restarting: another time
            self.tally.notes.append(f"terminate: {type(error).__name__}")
            return
        self.tally.notes.append("terminate: no worker commit caught")

    def _cut_one_commit(
        self, holder: psycopg.Connection[Any], probe: psycopg.Connection[Any]
    ) -> int | None:
        """In `holder`'s transaction, lock the leased rows (files' and re-derivations':
        a re-derivation's commit takes its own row's lock); for up to a second, look for
        a worker's commit blocked on them and terminate its backend. Its pid, or None."""
        held = 0
        for name in ("archive_files", "derivd_rederivations"):
            if holder.execute("SELECT to_regclass(%s)", (name,)).fetchone() != (None,):
                held += len(
                    holder.execute(
                        f"SELECT 1 FROM {name} WHERE status = 'processing' FOR UPDATE SKIP LOCKED"
                    ).fetchall()
                )
        if not held:
            return None
        blocked = (
            "SELECT pid, application_name FROM pg_stat_activity"
            " WHERE %s = ANY (pg_blocking_pids(pid))"
            " AND application_name LIKE 'derivd-worker-%%' AND query ILIKE '%%commit%%'"
        )
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            now = time.monotonic()
            victims = [
                (int(pid), str(name))
                for pid, name in probe.execute(blocked, (holder.info.backend_pid,))
                if now - self.cut_at.get(str(name), -RECUT_AFTER_S) >= RECUT_AFTER_S
            ]
            if victims:
                victim, name = self.rng.choice(sorted(victims))
                probe.execute("SELECT pg_terminate_backend(%s)", (victim,))
                self.cut_at[name] = now
                return victim
            time.sleep(0.01)
        return None

    def restart_postgres(self) -> None:
        """Stop and start PostgreSQL; the outage lasts until derivd's own DSN answers
        again (through PgBouncer, that is later: it waits before it logs in again)."""
        say("restarting PostgreSQL")
        began = time.time()
        self.world.pg.stop()  # the same instance starts again on its port and socket
        self.world.pg.start()
        self.tally.outages.append((began, self.world.reachable()))
        self.tally.pg_restarts += 1

    def freeze_past_lease(self, feed: Callable[[], None]) -> None:
        """SIGSTOP the supervisor and one busy worker until another worker has taken the
        job over (its lease expired), then thaw the worker: it must lose the fence."""
        world, proxy = self.world, self.world.proxy
        assert proxy is not None
        proxy.slow(0.7, 1.0)  # jobs take long enough to be caught in the middle
        feed()
        os.kill(world.sup_pid, signal.SIGSTOP)
        try:
            caught = self._catch_busy_worker(deadline=time.monotonic() + 20)
            proxy.pass_through()
            if caught is None:
                self.tally.notes.append("freeze: no worker caught mid-job")
                return
            pid, file_id, token = caught
            say(f"froze worker pid {pid} on file {file_id} (token {token})")
            try:
                taken = self._wait(
                    lambda: world.query(
                        "SELECT 1 FROM archive_files WHERE id = %s "
                        "AND lease_token IS DISTINCT FROM %s",
                        (file_id, token),
                    ),
                    LEASE_S * 8,
                )
                if not taken:
                    self.tally.notes.append(f"freeze: file {file_id} was not taken over")
            finally:
                os.kill(pid, signal.SIGCONT)
            self.tally.stunts += 1
            self.tally.stunt_tokens.append(token)
            say(f"thawed worker pid {pid} after file {file_id} moved on")
            # Let it try its late commit while the supervisor still sleeps (it would
            # otherwise kill the overdue worker first, which is also fenced but proves less).
            self._wait(
                lambda: world.query(
                    "SELECT 1 FROM archive_events WHERE lease_token = %s AND kind = 'lease_lost'",
                    (token,),
                ),
                30,
            )
        finally:
            os.kill(world.sup_pid, signal.SIGCONT)

    def _catch_busy_worker(self, deadline: float) -> tuple[int, int, str] | None:
        world = self.world
        while time.monotonic() < deadline:
            for pid, text in workers(world.sup_pid).items():
                file_id = job_of(text)
                if file_id is None:
                    continue
                os.kill(pid, signal.SIGSTOP)
                # Still on that job once stopped, and the row is leased: the token is its.
                # Claimed since the last PostgreSQL restart: a worker whose connection
                # the restart closed could not write late at all, fenced or not.
                rows = world.query(
                    "SELECT lease_token::text FROM archive_files WHERE id = %s"
                    " AND status = 'processing'"
                    " AND lease_until - make_interval(secs => %s) > to_timestamp(%s)",
                    (file_id, LEASE_S, max((end for _, end in self.tally.outages), default=0)),
                )
                if job_of(title(pid)) == file_id and rows:
                    return pid, file_id, rows[0][0]
                os.kill(pid, signal.SIGCONT)
            time.sleep(0.01)
        return None

    @staticmethod
    def _wait(check: Callable[[], Any], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return True
            time.sleep(0.1)
        return False


def run_chaos(
    world: World, plan: Plan, rng: random.Random, inputs: list[tuple[str, str, bytes]]
) -> tuple[dict[int, tuple[str, str]], Tally]:
    tally = Tally()
    chaos = Chaos(world, rng, tally)
    expected: dict[int, tuple[str, str]] = {}
    chunks = plan.waves + plan.stunts
    pending_waves = [inputs[i::chunks] for i in range(plan.waves)]
    # One batch kept back per freeze, so a worker is busy when it is time to catch one.
    reserve = [inputs[i::chunks] for i in range(plan.waves, chunks)]

    def feed() -> None:
        if pending_waves:
            expected.update(world.enqueue(pending_waves.pop(0)))

    def feed_reserve() -> None:
        if reserve:
            expected.update(world.enqueue(reserve.pop(0)))
        else:
            feed()

    # The schedule: (second, action); everything seeded.
    span = plan.chaos_s
    schedule: list[tuple[float, str]] = [(i * span / plan.waves, "wave") for i in range(plan.waves)]
    schedule += [(t, "faults") for t in _ticks(rng, span, 2.0)]
    schedule += [(rng.uniform(0.1, 0.9) * span, "kill") for _ in range(plan.kills)]
    schedule += [(0.4 * span, "pg_restart")]
    schedule += [(rng.uniform(0.1, 0.9) * span, "terminate") for _ in range(plan.terminations)]
    schedule += [(rng.uniform(0.2, 0.9) * span, "kill_waiting") for _ in range(plan.waiting_kills)]
    schedule += [(rng.uniform(0.1, 0.9) * span, "kill_deliverer") for _ in range(2)]
    schedule += [(rng.uniform(0.2, 0.8) * span, "receiver_restart")]
    schedule += [
        ((0.55 + 0.3 * n / max(1, plan.stunts)) * span, "freeze") for n in range(plan.stunts)
    ]
    schedule.sort()
    started = time.monotonic()
    for at, action in schedule:
        delay = started + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        if not world.supervisor_alive():
            tally.supervisor_died = True
            break
        if action == "wave":
            feed()
        elif action == "faults":
            chaos.switch_faults()
        elif action == "kill":
            chaos.kill_worker()
        elif action == "pg_restart":
            chaos.restart_postgres()
        elif action == "terminate":
            chaos.terminate_in_commit()
        elif action == "kill_waiting":
            chaos.kill_with_one_waiting(feed=feed)
        elif action == "kill_deliverer":
            if world.hooks.kill_deliverer(world.sup_pid, title):
                say("SIGKILL webhook deliverer")
        elif action == "receiver_restart":
            say("restarting the webhook receiver")
            world.hooks.restart(down_s=rng.uniform(0.5, 2.0))
        elif action == "freeze":
            chaos.freeze_past_lease(feed_reserve)
    while reserve:
        feed_reserve()
    while pending_waves:
        feed()
    assert world.proxy is not None
    world.proxy.pass_through()
    return expected, tally


def _ticks(rng: random.Random, span: float, every: float) -> list[float]:
    out, t = [], rng.uniform(0, every)
    while t < span:
        out.append(t)
        t += rng.uniform(0.5 * every, 1.5 * every)
    return out


def drain(world: World, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = world.query(
            "SELECT count(*) FROM archive_files WHERE status NOT IN ('ready', 'rejected')"
        )
        if rows[0][0] == 0:
            return True
        if not world.supervisor_alive():
            return False
        time.sleep(0.5)
    return False


# --------------------------------------------------------------------------- invariants


@dataclasses.dataclass
class Check:
    name: str
    ok: bool
    detail: str


def check_all(
    world: World, expected: dict[int, tuple[str, str]], tally: Tally, exit_code: int | None
) -> list[Check]:
    """The run's own expectations (each input's outcome, the freeze fenced, a clean
    stop, the bytes of every ready variant) and then the history checker's invariants
    (harness.invariants), which know nothing of this run but its configuration."""
    checks: list[Check] = []
    rows = {
        r[0]: r
        for r in world.query("SELECT id, status, error_code, derived_key FROM archive_files")
    }
    events = world.query("SELECT file_id, kind, lease_token::text FROM archive_events")
    kinds = Counter(kind for _, kind, _ in events)

    wrong: list[str] = []
    for file_id, (case, want) in expected.items():
        row = rows.get(file_id)
        got = None if row is None else ("ready" if row[1] == "ready" else row[2])
        if got != want:
            wrong.append(f"{file_id}:{case} want {want} got {got}")
    n_valid = sum(1 for _, w in expected.values() if w == "ready")
    checks.append(
        Check(
            "valid -> ready, hostile -> its content code",
            not wrong and len(rows) == len(expected),
            f"{len(rows)} rows, {n_valid} valid, {len(expected) - n_valid} hostile; "
            f"wrong: {wrong[:6]}",
        )
    )
    bad_codes = [
        f"{i}:{r[2]}"
        for i, r in rows.items()
        if r[1] == "rejected"
        and expected.get(i, ("", ""))[1] != "ready"
        and r[2] not in CONTENT_CODES
    ]
    checks.append(
        Check("hostile rejected with a content code", not bad_codes, f"others: {bad_codes[:6]}")
    )
    checks.append(_check_variant_bytes(world))

    lost = {tok for _, kind, tok in events if kind == "lease_lost"}
    unfenced = [t for t in tally.stunt_tokens if t not in lost]
    checks.append(
        Check(
            "frozen worker's late write fenced (lease_lost)",
            tally.stunts > 0 and not unfenced,
            f"{tally.stunts} freeze(s); without lease_lost: {unfenced}",
        )
    )
    checks.append(
        Check(
            "supervisor survived, exit 0 after SIGTERM",
            not tally.supervisor_died and exit_code == 0,
            f"exit code {exit_code}",
        )
    )
    checks.append(_check_deaths_recorded(world, tally))
    checks += history_checks(world, tally)
    checks += [Check(*c) for c in webhook_checks(world.query, world.hooks)]
    tally.notes.append("events: " + ", ".join(f"{k}={n}" for k, n in sorted(kinds.items())))
    return checks


def _check_deaths_recorded(world: World, tally: Tally) -> Check:
    jobs = [job for job, _ in tally.busy_kills]
    events = world.query(
        "SELECT file_id, kind, extract(epoch FROM at)::float8 FROM archive_events"
        " WHERE file_id = ANY(%s)",
        (jobs,),
    )
    missing = unrecorded_deaths(
        tally.busy_kills, [(int(f), str(k), float(a)) for f, k, a in events], tally.outages
    )
    return Check(
        "each busy worker killed: worker_died for its job",
        not missing,
        f"{len(tally.busy_kills)} busy kill(s); without worker_died: {missing}",
    )


def history_checks(world: World, tally: Tally) -> list[Check]:
    """Every invariant of the state machine over what the run left (events, tables, the
    bucket's listing), under the rules of the run's own configuration. The violations
    of a failing one go to the notes in full."""
    rules = Rules.from_config(load_config(world.ini))
    starts = derive_log.read(world.derive_log)
    history = load_history(
        world.dsn, s3_objects(world.s3(), world.bucket), starts, tally.disruptions()
    )
    verdicts = check_history(history, rules)
    for verdict in verdicts:
        tally.notes += [f"{verdict.name}: {v}" for v in verdict.violations[:40]]
    slow = {k for k, s in world.slow.items() if s}
    keys = {r.id: r.original_key for r in history.rows.values()}
    stretched = sum(1 for s in starts if s.attempt == 1 and keys.get(s.job) in slow)
    logged = Check(
        "the derive log was kept",
        bool(starts),
        f"{len(starts)} derive starts by {len({s.pid for s in starts})} processes, "
        f"{stretched} first derives for 50-90 % of job_timeout",
    )
    return [logged] + [Check(f"history: {v.name}", v.ok, v.summary()) for v in verdicts]


def _check_variant_bytes(world: World) -> Check:
    """Each ready variant's object, read by its version, has the sha256 recorded."""
    client = world.s3()
    variants = world.query(
        "SELECT v.file_id, v.name, v.key, v.version, v.sha256 FROM archive_variants AS v"
        " JOIN archive_files AS f ON f.id = v.file_id WHERE f.status = 'ready'"
    )
    problems: list[str] = []
    for file_id, name, key, version, digest in variants:
        try:
            body = client.get_object(Bucket=world.bucket, Key=key, VersionId=version)
            data = body["Body"].read()
        except Exception as error:
            problems.append(f"{file_id}/{name}: GET failed ({type(error).__name__})")
            continue
        if hashlib.sha256(data).hexdigest() != digest:
            problems.append(f"{file_id}/{name}: sha256 differs")
    return Check(
        "ready variants' bytes, by version, match their sha256",
        not problems,
        f"{len(variants)} variants read; {problems[:6]}",
    )


# --------------------------------------------------------------------------- main


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
