"""Fixtures on real services: an embedded PostgreSQL, moto's S3 server, a fault proxy.

Under pytest-xdist every worker starts its own PostgreSQL cluster and moto server (on free
ports), so workers share nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import boto3
import pytest
from fixtures.cli import run_cli as _run_cli
from fixtures.faultproxy import FaultProxy
from fixtures.pgbouncer import DIRECT_FOR, NO_PGBOUNCER, PgBouncer, find_pgbouncer
from fixtures.s3 import (
    AWS_ENV_UNSET,
    TEST_ACCESS_KEY,
    TEST_REGION,
    TEST_SECRET_KEY,
    MotoServer,
    aws_test_env,
)

from derivd.embedded.pgcluster import EmbeddedCluster, discard
from derivd.osproc import pid_alive
from derivd.queue.db import QueueDB

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

    from derivd.handlers.base import Handler

__all__ = ["TEST_ACCESS_KEY", "TEST_REGION", "TEST_SECRET_KEY"]

TEMPLATE_DB = "derivd_template"


# --------------------------------------------------------------------------- tiers
# unit: no services; integration: PostgreSQL and/or moto's S3; acceptance: the `derivd`
# process itself. A test's tier follows from the fixtures it uses (or an explicit
# marker), so `pytest -m unit` runs alone; with PYTEST_DERIVD_TIER=unit the service fixtures
# fail, which proves that the unit tier needs none.
SERVICE_FIXTURES = frozenset(
    {
        "pg_root",
        "pg_cluster",
        "pg_template",
        "dsn",
        "s3_server",
        "s3_client",
        "s3_bucket",
        "s3_bucket_unversioned",
        "faulty_s3",
        "pgbouncer",
        "direct_dsn",
    }
)
PROCESS_FIXTURES = frozenset({"run_cli", "supervisor", "idle_daemon"})


def tier_of(item: pytest.Item) -> str:
    fixtures = set(getattr(item, "fixturenames", ()))
    if item.get_closest_marker("acceptance") or fixtures & PROCESS_FIXTURES:
        return "acceptance"
    if item.get_closest_marker("integration") or fixtures & SERVICE_FIXTURES:
        return "integration"
    return "unit"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item)))


def _refuse_services_in_unit_tier() -> None:
    if os.environ.get("PYTEST_DERIVD_TIER") == "unit":
        pytest.fail("a unit-tier test asked for a service fixture")


def _worker_id() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


# --------------------------------------------------------------------------- PostgreSQL


_PG_ROOT_PREFIX = "derivd-pg-"


def _sweep_stale_pg_roots() -> None:
    """Stop and remove clusters left by test sessions that were killed (SIGKILL, CI
    timeout): their directory names carry the pid of the process that made them."""
    for root in Path(tempfile.gettempdir()).glob(f"{_PG_ROOT_PREFIX}*-*-*"):
        pid = root.name.removeprefix(_PG_ROOT_PREFIX).split("-")[1]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        with contextlib.suppress(Exception):
            discard(root / "pgdata")  # also its home, if the cluster had to move out
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_root() -> Iterator[Path]:
    _refuse_services_in_unit_tier()
    """A state directory the `postgres` user can traverse (pytest's own temp root is 0700)."""
    _sweep_stale_pg_roots()
    root = Path(tempfile.mkdtemp(prefix=f"{_PG_ROOT_PREFIX}{_worker_id()}-{os.getpid()}-"))
    root.chmod(0o711)  # traverse only: the cluster's own dirs stay private
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_cluster(pg_root: Path) -> Iterator[EmbeddedCluster]:
    """One fast (unsafe-on-crash) cluster per xdist worker, reachable over TCP for other
    processes and for a fault proxy."""
    cluster = EmbeddedCluster(pg_root / "pgdata", listen_tcp=True, fast=True)
    cluster.start()
    try:
        yield cluster
    finally:
        discard(pg_root / "pgdata")


@pytest.fixture(scope="session")
def pg_template(pg_cluster: EmbeddedCluster) -> str:
    """A database with every migration applied; each test clones it."""
    from derivd.queue.db import migrate

    pg_cluster.drop_database(TEMPLATE_DB)
    pg_cluster.create_database(TEMPLATE_DB)
    migrate(pg_cluster.dsn(TEMPLATE_DB))
    return TEMPLATE_DB


@pytest.fixture(scope="session")
def pgbouncer(request: pytest.FixtureRequest, pg_root: Path) -> Iterator[PgBouncer]:
    """PgBouncer in transaction mode (pool of 3 per database) in front of the cluster.
    Where none is installed every test that needs it skips, with one line for them all
    (checked before the cluster starts: a run without PgBouncer pays nothing for it)."""
    if find_pgbouncer() is None:
        pytest.skip(NO_PGBOUNCER)
    pg_cluster: EmbeddedCluster = request.getfixturevalue("pg_cluster")
    bouncer = PgBouncer(
        pg_root / "pgbouncer", pg_host="127.0.0.1", pg_port=pg_cluster.port, user="derivd"
    ).start()
    try:
        yield bouncer
    finally:
        bouncer.stop()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Modules marked `pooler` run each test on `dsn` twice: direct and through PgBouncer.
    if "dsn" in metafunc.fixturenames and metafunc.definition.get_closest_marker("pooler"):
        metafunc.parametrize("dsn", ["direct", "pgbouncer"], indirect=True)


_db_numbers = itertools.count(1)


@pytest.fixture
def dsn(
    request: pytest.FixtureRequest, pg_cluster: EmbeddedCluster, pg_template: str
) -> Iterator[str]:
    """A fresh, migrated, otherwise empty database for this test only (reached through
    PgBouncer when the test is parametrized so: see `pooler`)."""
    pooled = getattr(request, "param", "direct") == "pgbouncer"
    # Before the database exists: a missing PgBouncer skips the test here.
    bouncer: PgBouncer | None = request.getfixturevalue("pgbouncer") if pooled else None
    name = f"test_{next(_db_numbers)}"
    if not pg_cluster.is_running():  # a chaos test may have left it stopped
        pg_cluster.start()
    pg_cluster.create_database(name, template=pg_template)
    direct = pg_cluster.dsn(name)
    if bouncer is not None:
        yield bouncer.dsn(direct)
    else:
        yield direct
    if not pg_cluster.is_running():
        pg_cluster.start()
    pg_cluster.drop_database(name)


@pytest.fixture
def queue(dsn: str) -> Iterator[QueueDB]:
    """derivd's side of the test database: a connection of its own, as a worker's."""
    with QueueDB.open(dsn) as q:
        yield q


@pytest.fixture(scope="module")
def both(request: pytest.FixtureRequest) -> dict[str, Handler]:
    """Both built-in backends, made for the requesting module's `SPEC` (its variants)."""
    from derivd.handlers.registry import create_handler

    spec = request.module.SPEC
    return {name: create_handler(name, spec) for name in ("vips", "pillow")}


@pytest.fixture
def direct_dsn(dsn: str) -> str:
    """The test database without the pooler (what LISTEN and `listen_dsn` need)."""
    return DIRECT_FOR.get(dsn, dsn)


# --------------------------------------------------------------------------- S3 (moto)


@pytest.fixture(scope="session")
def aws_env() -> Iterator[dict[str, str]]:
    """Test credentials for the whole session; nothing points at a real AWS account."""
    mp = pytest.MonkeyPatch()
    for name in AWS_ENV_UNSET:
        mp.delenv(name, raising=False)
    env = aws_test_env()
    for name, value in env.items():
        mp.setenv(name, value)
    yield env
    mp.undo()


@pytest.fixture(scope="session")
def s3_server(
    aws_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MotoServer]:
    """moto's S3 over real HTTP. `.endpoint_url`; `.stop()`/`.start()` keep the port but
    moto comes back EMPTY (in-memory state): prefer `faulty_s3` for outages."""
    _refuse_services_in_unit_tier()
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _s3_client(endpoint_url: str) -> S3Client:
    client: S3Client = boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=TEST_REGION,
        aws_access_key_id=TEST_ACCESS_KEY,
        aws_secret_access_key=TEST_SECRET_KEY,
    )
    return client


@pytest.fixture
def s3_client(s3_server: MotoServer) -> S3Client:
    """A boto3 client talking straight to moto (no faults)."""
    if not s3_server.running:  # an outage test may have left it stopped
        s3_server.start()
    return _s3_client(s3_server.endpoint_url)


def _new_bucket(client: S3Client, versioned: bool) -> str:
    name = f"derivd-test-{uuid.uuid4().hex[:16]}"
    client.create_bucket(Bucket=name)
    if versioned:
        client.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    return name


@pytest.fixture
def s3_bucket(s3_client: S3Client) -> str:
    """A new bucket with versioning Enabled (moto forgets it when the session ends)."""
    return _new_bucket(s3_client, versioned=True)


@pytest.fixture
def s3_bucket_unversioned(s3_client: S3Client) -> str:
    """A new bucket without versioning, which derivd must refuse."""
    return _new_bucket(s3_client, versioned=False)


@pytest.fixture
def faulty_s3(s3_server: MotoServer) -> Iterator[tuple[str, FaultProxy]]:
    """(proxy URL, controller): a fault-injecting proxy in front of moto, seeded, in
    pass-through mode until the test says otherwise; stopped at teardown."""
    if not s3_server.running:
        s3_server.start()
    proxy = FaultProxy(("127.0.0.1", s3_server.port), seed=1234).start()
    try:
        yield proxy.url, proxy
    finally:
        proxy.stop()


# --------------------------------------------------------------------------- misc


@pytest.fixture
def fs_root(tmp_path: Path) -> Path:
    """An empty directory for the fs store."""
    root = tmp_path / "store"
    root.mkdir()
    return root


@pytest.fixture
def run_cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    """`run_cli("status", "--json", env={...})`: the real `derivd` as a subprocess."""
    return _run_cli
