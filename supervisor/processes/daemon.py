"""`derivd run`: bring up the database, then run the prefork supervisor until stopped.

The embedded database (an empty `[database] dsn`) is started here, in the parent, before
any fork; the children connect to it like to any other PostgreSQL. The pidfile and the
metrics endpoint (with the dashboard) live as long as the supervisor. See
`derivd.processes.supervisor` for the fleet and `derivd.processes.child` for one worker.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

from derivd.config import DEFAULTS, Config
from derivd.config_load import load_config
from derivd.embedded.runtime import database
from derivd.ops.durations import duration
from derivd.ops.metrics import Metrics, listening_line
from derivd.osproc import Pidfile, PidfileError
from derivd.processes.duties import host_info, listen_problem
from derivd.processes.hostclaim import claim_host
from derivd.processes.supervisor import RunResult, Supervisor
from derivd.queue.db import DatabaseUnavailable, HostInfo, QueueDB
from derivd.queue.webhook_queries import DeliveriesLeft
from derivd.redact import redact
from derivd.storage.configured import store_name

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
        host = _claim_host_id(config, dsn)
        if isinstance(host, str):
            return RunResult(2, host)
        metrics = Metrics()
        try:
            supervisor = Supervisor(
                config, dsn, burst=burst, metrics=metrics, reload=_reload_from(config), host=host
            )
            if config.metrics.listen:
                from derivd.ops.dashboard import Dashboard  # ~20 ms of imports: only to serve

                # The dashboard follows the supervisor's current config (SIGHUP reloads it).
                dashboard = Dashboard(dsn, lambda: supervisor.config, metrics)
                metrics.serve(
                    config.metrics.listen,
                    dashboard=dashboard.route,
                    where=config.where("metrics", "listen"),
                )
        except BaseException:
            # A start that fails here (the metrics port taken, ...) leaves no registry
            # row behind: the next start would wait for it to go stale.
            _leave_registry(dsn, host)
            raise
        log.info("%s", listening_line(metrics.address))
        try:
            result = supervisor.run()
        finally:
            metrics.close()
        if burst and result.code == 0:
            _say_what_is_left(dsn, [e.name for e in supervisor.config.webhooks])
        return result
    finally:
        if pidfile:
            pidfile.remove()


def left_behind(waiting: int, due_s: float | None) -> str | None:
    """The line a drained `run --burst` ends with when retries wait for their delay."""
    if not waiting or due_s is None:
        return None
    count = f"{waiting:,}" if waiting < 10_000 else "10,000 or more"
    when = time.strftime("%H:%M:%S", time.localtime(time.time() + due_s))
    return (
        f"left {count} queued row(s) waiting for a retry delay, the next due in "
        f"{duration(due_s)} (at {when}): run `derivd run --burst` again then, or `derivd run`"
    )


def deliveries_left_behind(left: DeliveriesLeft) -> str | None:
    """The line a `run --burst` ends with for an endpoint whose deliveries it could not
    make: retries due later than it waits, a circuit open longer, a deliverer that died."""
    if not left.waiting:
        return None
    count = f"{left.waiting:,}" if left.waiting < 10_000 else "10,000 or more"
    noun = "delivery" if left.waiting == 1 else "deliveries"
    due = max(0.0, left.next_due_s or 0.0)
    when = time.strftime("%H:%M:%S", time.localtime(time.time() + due))
    circuit = f", its circuit open for {duration(left.paused_s)}" if left.paused_s else ""
    return (
        f"left {count} webhook {noun} pending for endpoint {left.endpoint}, the next "
        f"due in {duration(due)} (at {when}){circuit}: run `derivd run --burst` again then, "
        "or `derivd run`"
    )


def _say_what_is_left(dsn: str, endpoints: list[str]) -> None:
    try:
        with QueueDB.open(dsn, role="derivd-supervisor") as queue:
            lines = [left_behind(*queue.not_yet_due())]
            if endpoints:
                lines += [deliveries_left_behind(d) for d in queue.deliveries_left(endpoints)]
    except DatabaseUnavailable as error:
        lines = [f"could not tell what is left: {error}"]
    for line in filter(None, lines):
        sys.stderr.write(f"derivd: {line}\n")
    sys.stderr.flush()


def _claim_host_id(config: Config, dsn: str) -> HostInfo | str:
    """This run's registry row, before the first fork; or why another run holds it.
    Records where the store is, too (the bucket webhooks and results name)."""
    with QueueDB.open(dsn, role="derivd-supervisor") as queue:
        queue.record_store(store_name(config))
        return claim_host(queue, host_info(config, busy=0))


def _leave_registry(dsn: str, host: HostInfo) -> None:
    with contextlib.suppress(DatabaseUnavailable), QueueDB.open(dsn, role="derivd-supervisor") as q:
        q.deregister_host(host.host, host.pid, host.started_at)


def _reload_from(config: Config) -> Callable[[], Config]:
    def reload() -> Config:
        if config.source == DEFAULTS:
            return load_config().signing()
        return load_config(Path(config.source), required=True).signing()

    return reload
