"""`derivd run`: bring up the database, then run the prefork supervisor until stopped.

The embedded database (an empty `[database] dsn`) is started here, in the parent, before
any fork; the children connect to it like to any other PostgreSQL. See
`derivd.processes.arbiter` for the fleet and `derivd.processes.child` for one worker process.
"""

from __future__ import annotations

import sys

from derivd.config import Config
from derivd.embedded.runtime import database
from derivd.processes.arbiter import Arbiter
from derivd.redact import redact


def run_daemon(config: Config, *, burst: bool = False, dsn: str | None = None) -> int:
    """Run until stopped (or, with `burst`, until the queue is drained). Returns the exit
    status: 0 after a clean stop; non-zero with one line on stderr when a worker could
    not start (bad configuration, database unreachable, missing library). A caller that
    already holds the database (`derivd demo`) passes its `dsn`."""
    if dsn is not None:
        outcome = Arbiter(config, dsn, burst=burst).run()
    else:
        with database(config) as opened:
            outcome = Arbiter(config, opened, burst=burst).run()
    if outcome.message:
        sys.stderr.write(f"derivd: {redact(outcome.message)}\n")
        sys.stderr.flush()
    return outcome.code
