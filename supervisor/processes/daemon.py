"""`derivd run`: bring up the database, then run the prefork supervisor until stopped.

The embedded database (an empty `[database] dsn`) is started here, in the parent, before
any fork; the children connect to it like to any other PostgreSQL. The pidfile and the
metrics endpoint (with the dashboard) live as long as the supervisor. See
`derivd.processes.supervisor` for the fleet and `derivd.processes.child` for one worker.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path

from derivd.config import DEFAULTS, Config, load_config
from derivd.embedded.runtime import database
from derivd.ops.dashboard import Dashboard
from derivd.ops.metrics import Metrics, listening_line
from derivd.osproc import Pidfile, PidfileError
from derivd.processes.duties import listen_problem
from derivd.processes.supervisor import RunResult, Supervisor
from derivd.redact import redact

log = logging.getLogger("derivd")


def startup_listen_problem(config: Config, dsn: str, *, burst: bool = False) -> str | None:
    """Why LISTEN would silently hear nothing, checked before the first fork: through a
    pooler wake-ups would be lost without a word, so refuse to start instead (a pooler
    that appears later is the Listening duty's to report)."""
    if burst or not config.queue.listen:
        return None
    return listen_problem(config, dsn)


def run_daemon(config: Config, *, burst: bool = False, dsn: str | None = None) -> int:
    """Run until stopped (or, with `burst`, until the queue is drained). Returns the exit
    status: 0 after a clean stop; non-zero with one line on stderr when a worker could
    not start (bad configuration, database unreachable, missing library). A caller that
    already holds the database (`derivd demo`) passes its `dsn`."""
    if dsn is not None:
        result = _supervise(config, dsn, burst)
    else:
        with database(config) as opened:
            result = _supervise(config, opened, burst)
    if result.message:
        sys.stderr.write(f"derivd: {redact(result.message)}\n")
        sys.stderr.flush()
    return result.code


def _supervise(config: Config, dsn: str, burst: bool) -> RunResult:
    problem = startup_listen_problem(config, dsn, burst=burst)
    if problem is not None:
        return RunResult(2, problem)
    path = config.supervisor.pidfile
    pidfile = Pidfile(Path(path)) if path else None
    try:
        if pidfile:
            pidfile.create()
    except PidfileError as error:
        return RunResult(1, str(error))
    try:
        metrics = Metrics()
        supervisor = Supervisor(
            config, dsn, burst=burst, metrics=metrics, reload=_reload_from(config)
        )
        if config.metrics.listen:
            # The dashboard follows the supervisor's current config (SIGHUP reloads it).
            dashboard = Dashboard(dsn, lambda: supervisor.config, metrics)
            metrics.serve(
                config.metrics.listen,
                dashboard=dashboard.route,
                where=config.where("metrics", "listen"),
            )
        log.info("%s", listening_line(metrics.address))
        try:
            return supervisor.run()
        finally:
            metrics.close()
    finally:
        if pidfile:
            pidfile.remove()


def _reload_from(config: Config) -> Callable[[], Config]:
    def reload() -> Config:
        if config.source == DEFAULTS:
            return load_config()
        return load_config(Path(config.source), required=True)

    return reload
