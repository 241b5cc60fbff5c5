"""The chaos run's world: an embedded PostgreSQL (TCP), moto's S3 behind a fault-injecting
proxy, the real `derivd run` over them, the seeded inputs, and the workers found by title."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
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

from derivd.embedded.pgcluster import EmbeddedCluster
from derivd.osproc import children_of
from derivd.queue.db import QueueDB, migrate
from derivd.storage.base import new_original_key
from harness import derive_log
from harness.chaos_webhooks import Hooks

ROOT = Path(__file__).resolve().parent.parent
DERIVD = Path(sys.executable).parent / "derivd"
LEASE_S = 8.0
JOB_TIMEOUT_S = 4.0
MAX_ATTEMPTS = 8
# The final sweep removes every orphan prefix through moto, one listing each: minutes on
# a loaded machine. A bound on a hang, not a timing.
SWEEP_BOUND_S = 600.0
CONTENT_CODES = {"corrupt_content", "unsupported_content", "resource_limit"}

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
