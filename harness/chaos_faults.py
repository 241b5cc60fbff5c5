"""The chaos run's faults and their schedule: storage faults, killed and frozen workers, a
commit cut, a PostgreSQL restart, the waves of inputs, and the drain after them."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg

from harness import derive_log
from harness.chaos_world import LEASE_S, World, job_of, say, title, workers
from harness.history import Disruptions


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
    schedule += [(t, "faults") for t in ticks(rng, span, 2.0)]
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


def ticks(rng: random.Random, span: float, every: float) -> list[float]:
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
