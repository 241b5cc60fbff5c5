"""Webhooks beside the supervisor: the endpoint sync (a duty on the database thread) and
the delivering process (a child the supervisor keeps alive).

The parent never makes an HTTP call: deliveries are POSTed by one long-lived child
(derivd.webhooks.deliverer) while `[webhook:NAME]` sections exist. A child that dies is
forked again after a backoff; SIGHUP replaces it with one of the new configuration (the
old one is asked to stop, its POSTs in flight end within their timeout; whatever it
could not finish comes back when its leases expire). The sync puts this host's endpoints
in the database at start, on SIGHUP and every SYNC_INTERVAL_S (a start while the
database was away heals): they are what the outbox subscribes. With `[webhook:NAME]`
sections the first workers start once the first sync has ended, so that their first
commits find this configuration's endpoints (a fleet that starts with new sections
announces its first files too); without any, they start at once (an endpoint removed
from the file may get a few more deliveries queued meanwhile: the sync ends them).

An endpoint no longer in the file is removed by the sync, whether the file lost it by
SIGHUP or the host restarted without it, with or without any section left: its
undelivered deliveries end `failed` ("endpoint removed"), counted under its name in
status and the metrics, replayable (`derivd webhooks replay --failed --endpoint NAME`)
once it is configured again. Every host of a fleet syncs the set its own file holds, so
the hosts of one database carry the same `[webhook:NAME]` sections.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from derivd.config import Config
from derivd.logs import event
from derivd.ops.metrics import Metrics
from derivd.osproc import set_proctitle
from derivd.processes.dbthread import DatabaseThread
from derivd.processes.duties import DatabaseDuty
from derivd.processes.forked import become_child, exit_code, fork_child
from derivd.queue.db import QueueDB
from derivd.queue.webhook_queries import EndpointSync
from derivd.worker import BURST_RETRY_WAIT_S

log = logging.getLogger("derivd.webhooks")

SYNC_INTERVAL_S = 60.0
RESTART_BACKOFF_S = (1.0, 30.0)  # first, most
STOP_WAIT_S = 15.0


class WebhookSync(DatabaseDuty[EndpointSync]):
    name = "webhook_sync"

    @property
    def interval(self) -> float:
        return SYNC_INTERVAL_S

    def __init__(self, config: Callable[[], Config], thread: DatabaseThread | None = None) -> None:
        super().__init__(config, thread)
        self.settled = False  # the first round has ended (either way)

    def run_once(self, db: QueueDB) -> EndpointSync:
        return db.sync_webhook_endpoints([e.subscription() for e in self.config().webhooks])

    def on_result(self, result: EndpointSync | None) -> None:
        self.settled = True
        if result is None:
            return
        if result.removed or result.changed or result.stranded:
            event(log, "webhook endpoints synced",
                  logging.WARNING if result.stranded else logging.INFO,
                  removed=",".join(result.removed) or "-",
                  changed=",".join(result.changed) or "-",
                  undelivered_failed=result.stranded)  # fmt: skip

    def now(self) -> None:
        """A round at the next tick (a reload)."""
        self.due_at = 0.0


class WebhookStats(DatabaseDuty[list[dict[str, Any]]]):
    """The webhook gauges, every [metrics] interval, while endpoints are configured or
    the last reading listed some (removed ones whose failed rows are kept)."""

    name = "webhook_stats"

    def __init__(self, config: Callable[[], Config], thread: DatabaseThread, metrics: Metrics):
        super().__init__(config, thread)
        self.metrics = metrics
        self.listed = True  # until a reading says otherwise: endpoints may be left over

    @property
    def interval(self) -> float:
        return self.config().metrics.interval

    def run_once(self, db: QueueDB) -> list[dict[str, Any]]:
        config = self.config()
        wanted = config.webhooks or self.listed
        return db.webhook_stats(window_s=config.status.window) if wanted else []

    def on_result(self, result: list[dict[str, Any]] | None) -> None:
        if result is not None:
            self.listed = bool(result)
            self.metrics.set_webhooks(result)


class WebhookChild:
    """The delivering process: forked while endpoints exist, replaced when it dies.

    Under `run --burst` it delivers while the workers work; once they drained the queue
    (`finish`), the running child stops and a last one delivers what is leased or due
    within BURST_RETRY_WAIT_S (the workers' own rule for retries), then ends: `done`. What
    it leaves is named on the way out (derivd.processes.daemon)."""

    def __init__(
        self,
        config: Callable[[], Config],
        dsn: str,
        inherited_fds: Callable[[], tuple[int, ...]] = tuple,
    ) -> None:
        self.config = config
        self.dsn = dsn
        self.inherited_fds = inherited_fds
        self.pid: int | None = None
        self.started = 0.0
        self.not_before = 0.0
        self.failures = 0
        self.active = False
        self.draining = False  # --burst: the queue is drained, the last child drains
        self.drain_child = False  # the running child is that last one
        self.drained = False  # and it has ended

    @property
    def done(self) -> bool:
        """Nothing (more) to deliver from here: no endpoint, or the last child ended."""
        return not self.config().webhooks or self.drained

    def start(self, now: float) -> None:
        self.active = True
        self.tick(now)

    def tick(self, now: float) -> None:
        self.reap()
        if self.drained or not (self.active and self.pid is None and now >= self.not_before):
            return
        if self.config().webhooks:
            self.launch()

    def finish(self) -> None:
        """`run --burst` drained the queue: the running child stops (its POSTs in flight
        end first), then the last one starts (`tick`)."""
        if not self.draining:
            self.draining = True
            self._stop_child(wait=False)

    def reload(self) -> None:
        """The configuration changed: the running child stops, a new one starts."""
        self._stop_child(wait=False)

    def launch(self) -> None:
        self.drain_child = self.draining
        self.pid = fork_child(self._child, self.inherited_fds())
        self.started = time.monotonic()

    def reap(self) -> None:
        if self.pid is None:
            return
        code = exit_code(self.pid)
        if code is None:
            return
        lived = time.monotonic() - self.started
        self.pid = None
        if self.drain_child:
            self.drained = True  # whatever its end: what it left is said on the way out
            if code != 0:
                event(log, "webhook deliverer died draining", logging.WARNING, code=code)
            return
        if code != 0 and self.active:
            self.failures = 0 if lived > RESTART_BACKOFF_S[1] else self.failures + 1
            first, most = RESTART_BACKOFF_S
            delay = min(most, first * 2 ** max(self.failures - 1, 0))
            self.not_before = time.monotonic() + delay
            event(log, "webhook deliverer died; restarting", logging.WARNING, code=code,
                  restart_in_s=delay)  # fmt: skip

    def stop(self) -> None:
        self.active = False
        self._stop_child(wait=True)

    def _stop_child(self, *, wait: bool) -> None:
        if self.pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        if not wait:
            return  # reaped by a later tick; a new one starts then
        deadline = time.monotonic() + STOP_WAIT_S
        while self.pid is not None and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.05)
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            self.pid = None

    def _child(self, parent: int, inherited_fds: tuple[int, ...]) -> None:
        code = 1
        try:
            become_child(parent, close_fds=inherited_fds)  # SIGTERM: run_deliverer's own
            set_proctitle("derivd: webhooks")
            code = run_deliverer(self.config(), self.dsn, drain=self.drain_child)
        except Exception:
            log.exception("webhook deliverer failed")
        finally:
            os._exit(code)


def run_deliverer(config: Config, dsn: str, *, drain: bool = False) -> int:
    """The child's body: deliver until SIGTERM (in-flight POSTs finish first); `drain`:
    until nothing is leased or due within BURST_RETRY_WAIT_S, too."""
    from derivd.webhooks.deliverer import Deliverer

    deliverer = Deliverer(
        config.webhooks,
        dsn,
        host=config.host_id,
        listen_dsn=config.database.listen_dsn or None,
        poll_interval=config.queue.poll_interval,
        drain_within_s=BURST_RETRY_WAIT_S if drain else None,
    )
    signal.signal(signal.SIGTERM, lambda *_: deliverer.stop())
    try:
        deliverer.run()
    finally:
        deliverer.close()
    return 0
