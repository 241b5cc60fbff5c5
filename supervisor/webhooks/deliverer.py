"""The delivering process's loop: claim due deliveries per endpoint, POST them on a
thread pool, finish each with its fenced statement.

Each endpoint has `concurrency` slots on this host: a slot free is a claim of that many
rows of that endpoint (SKIP LOCKED, a lease that outlasts the POST's hard timeout), so
one slow or dead endpoint only ever fills its own slots. Its circuit (fleet-wide, in
the database) opens after consecutive failures: then its claims stop as a whole, and
one probe at a time goes out after a pause that grows with failed probes (to
`circuit_max`); the first success closes it and its backlog is due at once. The loop
sleeps on the `derivd_deliveries` notification (any new delivery, any replay), a slot
coming free, or `poll_interval` at most; a database outage is waited out (every
statement retries with the next round) and a delivery whose end could not be recorded
comes back when its lease expires: delivered at least once, with the same webhook-id.

`drain_within_s` (the last deliverer of `run --burst`): instead of waiting for more, it
ends once nothing is claimable, none of its POSTs is in flight and none of its endpoints
has a delivery leased or due within that many seconds (a retry due later, or behind a
circuit open longer, is left for the next run). Bounded: each POST ends within its
endpoint's timeout, and an endpoint that keeps failing opens its circuit for longer
and longer (retry_base, doubling per failed probe), past the wait within a few probes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from derivd.errors import Transient
from derivd.logs import event
from derivd.queue.db import QueueDB, QueueListener
from derivd.queue.webhook_queries import DELIVERIES_CHANNEL, Circuit, Delivery, Finished
from derivd.webhooks.endpoints import Endpoint
from derivd.webhooks.policy import decide, error_text
from derivd.webhooks.sender import post
from derivd.webhooks.signing import headers

log = logging.getLogger("derivd.webhooks")

OUTAGE_WAIT_S = 1.0


def lease_for(endpoint: Endpoint) -> float:
    """A delivery's lease: the POST's hard timeout twice, and time to record its end."""
    return 2 * endpoint.timeout + 30.0


def circuit_for(endpoint: Endpoint) -> Circuit:
    """Its circuit's pauses: from retry_base, doubling per failed probe, to circuit_max."""
    return Circuit(
        pause_base=min(endpoint.retry_base, endpoint.circuit_max), pause_max=endpoint.circuit_max
    )


class Deliverer:
    def __init__(
        self,
        endpoints: tuple[Endpoint, ...],
        dsn: str,
        *,
        host: str,
        listen_dsn: str | None = None,
        poll_interval: float = 1.0,
        clock: Callable[[], float] = time.time,
        drain_within_s: float | None = None,
    ) -> None:
        self.endpoints = {e.name: e for e in endpoints}
        self.drain_within_s = drain_within_s
        self.dsn = dsn
        self.host = host
        self.poll_interval = poll_interval
        self.clock = clock
        self.db = QueueDB.open(dsn, role="derivd-webhooks")
        self.db_lock = threading.Lock()  # one connection, shared by the POSTing threads
        self.listener = QueueListener(listen_dsn or dsn, channel=DELIVERIES_CHANNEL)
        self.busy = dict.fromkeys(self.endpoints, 0)
        self.busy_lock = threading.Lock()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        slots = sum(e.concurrency for e in endpoints) or 1
        self.pool = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="webhook")
        self.stopping = threading.Event()

    # -- the loop ----------------------------------------------------------------------

    def run(self) -> None:
        while not self.stopping.is_set():
            self.listener.connect()
            try:
                claimed = self.claim_round()
                if not claimed and self.drained():
                    break
            except Transient as error:
                event(log, "webhooks: database unavailable", logging.WARNING, error=str(error))
                self.wait(OUTAGE_WAIT_S)
                continue
            if not claimed:
                self.wait(self.poll_interval)
        self.pool.shutdown(wait=True)

    def drained(self) -> bool:
        """Draining (`drain_within_s`), nothing of ours in flight, and nothing leased or
        due soon for our endpoints."""
        if self.drain_within_s is None:
            return False
        with self.busy_lock:
            if any(self.busy.values()):
                return False
        with self.db_lock:
            waiting = self.db.deliveries_due_within(
                list(self.endpoints), within_s=self.drain_within_s
            )
        return not waiting

    def claim_round(self) -> int:
        """Claim into every endpoint's free slots; returns how many were claimed."""
        claimed = 0
        for endpoint in self.endpoints.values():
            with self.busy_lock:
                free = endpoint.concurrency - self.busy[endpoint.name]
            if free <= 0:
                continue
            with self.db_lock:
                rows = self.db.claim_deliveries(
                    endpoint.name, limit=free, lease_s=lease_for(endpoint), host=self.host
                )
            for delivery in rows:
                with self.busy_lock:
                    self.busy[endpoint.name] += 1
                self.pool.submit(self.deliver_and_free, endpoint, delivery)
            claimed += len(rows)
        return claimed

    def wait(self, timeout: float) -> None:
        fds = [self.wake_r]
        listen_fd = self.listener.fileno()
        if listen_fd is not None:
            fds.append(listen_fd)
        try:
            ready, _, _ = select.select(fds, [], [], timeout)
        except InterruptedError:
            return
        if self.wake_r in ready:
            os.read(self.wake_r, 4096)
        self.listener.drain()

    def stop(self) -> None:
        self.stopping.set()
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe: awake already
            os.write(self.wake_w, b"x")

    # -- one delivery ------------------------------------------------------------------

    def deliver_and_free(self, endpoint: Endpoint, delivery: Delivery) -> None:
        try:
            self.deliver(endpoint, delivery)
        except Transient as error:
            # Its end is not recorded: the lease expires and the delivery comes back.
            event(log, "webhook: outcome not recorded", logging.WARNING,
                  endpoint=endpoint.name, delivery=delivery.id, error=str(error))  # fmt: skip
        except Exception:
            log.exception("webhook delivery %s failed unexpectedly", delivery.id)
        finally:
            with self.busy_lock:
                self.busy[endpoint.name] -= 1
            self._wake()

    def deliver(self, endpoint: Endpoint, delivery: Delivery) -> None:
        body = delivery.body
        now = self.clock()
        sent = headers(endpoint.signing_key(), delivery.webhook_id, int(now), body)
        response = post(endpoint.url, body.encode(), sent, timeout=endpoint.timeout)
        decision = decide(
            response,
            attempt=delivery.attempt,
            age_s=delivery.age_s,
            horizon_s=endpoint.retry_horizon,
            base_s=endpoint.retry_base,
            now=self.clock(),
        )
        error = error_text(response)
        with self.db_lock:
            finished = self.db.finish_delivery(
                delivery,
                status=decision.status,
                delay_s=decision.delay_s,
                http_status=response.status,
                error=error,
                circuit=circuit_for(endpoint),
            )
        self.log_circuit(endpoint, finished, error)
        event(log, "webhook " + ("attempt ended" if finished.kept else "lease lost"),
              logging.DEBUG if decision.status == "delivered" else logging.WARNING,
              endpoint=endpoint.name, delivery=delivery.id, event_type=delivery.event,
              file_id=delivery.file_id, attempt=delivery.attempt, outcome=decision.status,
              status=response.status or "-", error=error or "-",
              probe="yes" if delivery.probe else "no")  # fmt: skip

    def log_circuit(self, endpoint: Endpoint, finished: Finished, error: str | None) -> None:
        if finished.opened:
            event(log, "webhook circuit opened: one probe at a time", logging.WARNING,
                  endpoint=endpoint.name, next_probe_in_s=round(finished.pause_s or 0.0, 1),
                  error=error or "-")  # fmt: skip
        elif finished.closed:
            event(log, "webhook circuit closed: the backlog flows", logging.INFO,
                  endpoint=endpoint.name)  # fmt: skip

    def close(self) -> None:
        self.listener.close()
        self.db.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
