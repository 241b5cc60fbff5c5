"""Resolve what a command runs against: the configured database or the embedded one."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from derivd.config import Config
from derivd.queue.db import check_schema, in_schema, migrate
from derivd.redact import mask_dsn
from derivd.storage.configured import store_name

if TYPE_CHECKING:
    from derivd.embedded.pgcluster import EmbeddedCluster

log = logging.getLogger("derivd")


def embedded_cluster(config: Config) -> EmbeddedCluster:
    """The private cluster of an empty `[database] dsn` (nothing is started or made)."""
    from derivd.embedded.pgcluster import EmbeddedCluster

    return EmbeddedCluster(
        config.state_dir / "pg", log_file=config.state_dir / "postgres.log", watchdog=True
    )


@contextmanager
def database(
    config: Config,
    *,
    auto_migrate: bool = True,
    check: bool = True,
    read_only: bool = False,
    create: bool = True,
) -> Iterator[str]:
    """Yield a DSN. An empty `[database] dsn` starts the private cluster under state_dir
    (and stops it on exit if this process started it); derivd owns that database, so its
    schema is brought up to date at once. A configured database is migrated only by
    `derivd migrate`. The DSN finds derivd's tables in `[database] schema` (in_schema).
    With `check` (every command but `migrate`) the schema must be this
    version's, else SchemaMismatch before the caller does anything.

    `read_only` (commands that only look: `status`, `show`) never creates a cluster nor
    migrates one: without an embedded cluster under state_dir it raises
    EmbeddedClusterError, so a command run with another state directory (another working
    directory, a misspelled setting) says so instead of reporting on an empty new database.
    Without `create` (commands that work on files already there: `enqueue`, `delete`,
    `retry`, `backfill`) the same: a new cluster there would hold files no daemon serves.
    """
    schema = config.database.schema
    if config.database.dsn:
        log.debug("database %s", mask_dsn(config.database.dsn))
        dsn = in_schema(config.database.dsn, schema)
        if check:
            check_schema(dsn)
        yield dsn
        return
    from derivd.embedded.pgcluster import EmbeddedClusterError

    cluster = embedded_cluster(config)
    if (read_only or not create) and not cluster.exists():
        raise EmbeddedClusterError(no_cluster_message(config))
    with cluster:
        dsn = in_schema(cluster.dsn(), schema)
        if auto_migrate and not read_only:
            applied = migrate(dsn, store_name(config), schema)
            if applied:
                log.info("embedded database migrated: %s", ", ".join(applied))
        if check:
            check_schema(dsn)
        yield dsn


def no_cluster_message(config: Config) -> str:
    """One line for a command that needs the embedded cluster where there is none."""
    return (
        f"no embedded database under {config.state_dir} ([database] dsn is empty and "
        f"nothing has run with this configuration ({config.source})): `derivd run` or "
        "`derivd demo` makes one; to use another one, run from its directory or name its "
        "config with -c (or set [database] dsn)"
    )


def describe_database(config: Config) -> str:
    """Comment lines for `derivd config show`: which database the config names, and for
    the embedded one, the DSN to reach it with (nothing is started)."""
    if config.database.dsn:
        return f"# database: {mask_dsn(config.database.dsn)}\n"
    dsn, running = embedded_cluster(config).peek_dsn()
    state = "running" if running else "not running (`derivd run` or `derivd demo` start it)"
    return (
        f"# database: the embedded PostgreSQL cluster under {config.state_dir}, {state}\n"
        f"# its DSN (psql, [database] dsn of another tool): {dsn}\n"
    )
