"""Resolve what a command runs against: the configured database or the embedded one."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from derivd.config import Config
from derivd.queue.db import check_schema, migrate
from derivd.redact import mask_dsn

log = logging.getLogger("derivd")


@contextmanager
def database(config: Config, *, auto_migrate: bool = True, check: bool = True) -> Iterator[str]:
    """Yield a DSN. An empty `[database] dsn` starts the private cluster under state_dir
    (and stops it on exit if this process started it); derivd owns that database, so its
    schema is brought up to date at once. A configured database is migrated only by
    `derivd migrate`. With `check` (every command but `migrate`) the schema must be this
    version's, else SchemaMismatch before the caller does anything.
    """
    if config.database.dsn:
        log.debug("database %s", mask_dsn(config.database.dsn))
        if check:
            check_schema(config.database.dsn)
        yield config.database.dsn
        return
    from derivd.embedded.pgcluster import EmbeddedCluster

    cluster = EmbeddedCluster(config.state_dir / "pg", log_file=config.state_dir / "postgres.log")
    with cluster:
        dsn = cluster.dsn()
        if auto_migrate:
            applied = migrate(dsn)
            if applied:
                log.info("embedded database migrated: %s", ", ".join(applied))
        if check:
            check_schema(dsn)
        yield dsn
