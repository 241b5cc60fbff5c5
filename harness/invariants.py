"""The state machine's invariants (DESIGN.md "The state machine", "The lease protocol"),
checked over a whole `History`: each a pure function that says how much it checked and
describes every violation precisely enough to find it in the tables.

Written from the design, not from derivd's code: they need only the records a run left.
`check` runs them all; `table_rows` prints them the way bench/ prints its tables.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from harness.history import FINAL, LIVE, DeriveStart, Event, History, StoredObject

if TYPE_CHECKING:
    from derivd.config import Config

# An attempt's own outcome, each fenced by its token: the row leaves `processing`.
ENDS_ATTEMPT = ("ready", "retry", "rejected", "released", "exhausted", "worker_died")
LOSSES = ("lease_lost", "worker_died")


@dataclass(frozen=True)
class Rules:
    """What the run was configured with."""

    max_attempts: int
    # slot (`name.format`) -> fingerprint (None: not compared), in configured order: the
    # first is the primary variant that derived_* describe.
    slots: Mapping[str, str | None]
    tenant_cap: int = 0  # [queue] max_in_flight_per_tenant (0: none)
    job_timeout: float = 0.0  # [supervisor] job_timeout (0: timeouts not measured)
    lease: float = 0.0  # [queue] lease (0: unknown)

    @classmethod
    def from_config(cls, config: Config) -> Rules:
        """The rules a derivd configuration sets: its cap, its variant set (with the
        fingerprint of the spec each slot is made by), its tenant cap, its job timeout
        and lease."""
        from derivd.fingerprint import configured_set

        return cls(
            max_attempts=config.queue.max_attempts,
            slots=configured_set(config.derive_spec(), config.derive.backend),
            tenant_cap=config.queue.max_in_flight_per_tenant,
            job_timeout=config.supervisor.job_timeout,
            lease=config.queue.lease,
        )


@dataclass
class Verdict:
    name: str
    checked: int
    unit: str
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self, limit: int = 4) -> str:
        text = f"{self.checked} {self.unit}"
        if self.violations:
            text += f"; {len(self.violations)} violation(s): " + "; ".join(self.violations[:limit])
        return text


def _short(token: str | None) -> str:
    return token[:8] if token else "-"


# --------------------------------------------------------------------------- variants


def ready_has_configured_set(history: History, rules: Rules) -> Verdict:
    """No file `ready` without exactly its configured variant set (slots and the spec
    that made each), and derived_* naming its primary variant."""
    verdict = Verdict("ready files hold exactly the configured variant set", 0, "ready files")
    variants = history.variants_of()
    primary = next(iter(rules.slots), None)
    for row in history.rows.values():
        if row.status != "ready" or row.rederive_of is not None:
            continue
        verdict.checked += 1
        stored = {v.slot: v for v in variants.get(row.id, [])}
        missing = [s for s in rules.slots if s not in stored]
        extra = [s for s in stored if s not in rules.slots]
        changed = [
            f"{s} (fingerprint {stored[s].fingerprint}, configured {want})"
            for s, want in rules.slots.items()
            if want is not None and s in stored and stored[s].fingerprint != want
        ]
        problems = [f"missing {missing}"] * bool(missing) + [f"extra {extra}"] * bool(extra)
        problems += [f"made by another spec: {changed}"] * bool(changed)
        if primary in stored:
            first = stored[primary]
            if (row.derived_key, row.derived_version, row.sha256) != (
                first.key,
                first.version,
                first.sha256,
            ):
                problems.append(f"derived_* is not its primary variant {primary}")
        if problems:
            verdict.violations.append(f"file {row.id}: " + ", ".join(problems))
    return verdict


def variants_from_their_commit(history: History, rules: Rules) -> Verdict:
    """Every stored variant was made by the attempt whose commit installed the file's
    set: the token of its last `ready` or `rederived` event, and in its key."""
    verdict = Verdict("variants belong to the commit that installed them", 0, "variants")
    installed: dict[int, str | None] = {}
    for event in history.events:
        if event.kind in ("ready", "rederived"):
            installed[event.file_id] = event.lease_token
    for variant in history.variants:
        verdict.checked += 1
        commit = installed.get(variant.file_id)
        if variant.lease_token != commit:
            verdict.violations.append(
                f"file {variant.file_id} {variant.slot}: token {_short(variant.lease_token)}, "
                f"installed by {_short(commit)}"
            )
        elif f"/{variant.lease_token}/" not in variant.key:
            verdict.violations.append(
                f"file {variant.file_id} {variant.slot}: key {variant.key} is not its token's"
            )
    return verdict


# --------------------------------------------------------------------------- commits


def one_commit_per_attempt(history: History, rules: Rules) -> Verdict:
    """No two `ready` commits for one attempt (token), nor for one row: ready is final."""
    verdict = Verdict("no two ready commits for one attempt", 0, "ready events")
    by_token: dict[str | None, list[Event]] = {}
    by_row: dict[int, list[Event]] = {}
    for event in history.events:
        if event.kind == "ready":
            verdict.checked += 1
            by_token.setdefault(event.lease_token, []).append(event)
            by_row.setdefault(event.file_id, []).append(event)
    for token, events in by_token.items():
        if len(events) > 1:
            verdict.violations.append(
                f"token {_short(token)}: {len(events)} ready events (ids {[e.id for e in events]})"
            )
    for file_id, events in by_row.items():
        if len({e.lease_token for e in events}) > 1:
            verdict.violations.append(
                f"file {file_id}: ready by {len(events)} attempts "
                f"{[(e.attempt, _short(e.lease_token)) for e in events]}"
            )
    return verdict


# The phases a row's events can move it through: `live` (queued or processing; claims
# are not all recorded, so the two are one phase), then the final or deletion states.
# lease_lost, timeout and worker_died move nothing themselves: a loss is recorded whether
# or not its fence held (a worker's death returns its job with a `retry`-like move only
# while the row is still its own, which the row's state shows).
_MOVES: dict[str, tuple[tuple[str, ...], str]] = {
    "claimed": (("live",), "live"),
    "ready": (("live",), "ready"),
    "retry": (("live",), "live"),
    "released": (("live",), "live"),
    "rejected": (("live",), "rejected"),
    "exhausted": (("live",), "rejected"),
    "operator_retry": (("rejected",), "live"),
    "rederived": (("ready",), "ready"),
    "rederive_rejected": (("ready",), "ready"),  # the file keeps its set
    "delete_requested": (("live", "ready", "rejected"), "deleting"),
    "deleted": (("deleting",), "deleted"),
}


def final_states_stay_final(history: History, rules: Rules) -> Verdict:
    """Every row's events follow the state machine (ready and rejected are left only by
    deletion or an operator's retry, deletion revokes the right to commit), and the row
    ends in the state its history reached."""
    verdict = Verdict("every row's events follow the state machine", 0, "events")
    events = history.events_of()
    for file_id, mine in events.items():
        phase = "live"
        for event in mine:
            move = _MOVES.get(event.kind)
            if move is None:
                continue
            verdict.checked += 1
            allowed, after = move
            if phase not in allowed:
                verdict.violations.append(
                    f"file {file_id}: {event.kind} (event {event.id}, attempt "
                    f"{event.attempt}, token {_short(event.lease_token)}) while {phase}"
                )
            phase = after
        row = history.rows.get(file_id)
        if row is None or row.rederive_of is not None:
            # A re-derivation's job (gone with its commit, or rejected): its outcome is
            # its file's event (`rederived`, `rederive_rejected`), checked there.
            continue
        now = "live" if row.status in ("pending", "queued", "processing") else row.status
        if now != phase:
            verdict.violations.append(f"file {file_id}: row is {row.status}, events say {phase}")
    for row in history.rows.values():
        if (
            row.status in ("ready", "rejected", "deleting", "deleted")
            and row.rederive_of is None
            and row.id not in events
        ):
            verdict.violations.append(f"file {row.id}: {row.status} without any event")
    return verdict


# --------------------------------------------------------------------------- attempts


def attempts_within_cap(history: History, rules: Rules) -> Verdict:
    """Attempts never above [queue] max_attempts: no row, no event of an attempt."""
    unit = f"rows and events (cap {rules.max_attempts})"
    verdict = Verdict("attempts never above the cap", 0, unit)
    for row in history.rows.values():
        verdict.checked += 1
        if row.attempts > rules.max_attempts:
            verdict.violations.append(f"file {row.id}: {row.attempts} attempts ({row.status})")
    for event in history.events:
        if event.attempt is None:
            continue
        verdict.checked += 1
        if event.attempt > rules.max_attempts:
            verdict.violations.append(
                f"file {event.file_id}: {event.kind} of attempt {event.attempt} "
                f"(event {event.id}, token {_short(event.lease_token)})"
            )
    return verdict


def losses_followed_up(history: History, rules: Rules) -> Verdict:
    """Every lease_lost / worker_died is followed by a new attempt of its file or a
    final state: a lost attempt never strands its file."""
    verdict = Verdict("every lost attempt followed by a new one or a final state", 0, "losses")
    events = history.events_of()
    for file_id, mine in events.items():
        row = history.rows.get(file_id)
        for loss in (e for e in mine if e.kind in LOSSES):
            verdict.checked += 1
            if row is None or row.status in FINAL:
                continue  # final (or a re-derivation's job row, consumed by its commit)
            later = [
                e
                for e in mine
                if e.lease_token not in (None, loss.lease_token)
                and (e.id > loss.id or (e.attempt or 0) > (loss.attempt or 0))
            ]
            running = row.lease_token not in (None, loss.lease_token)
            if not later and not running:
                verdict.violations.append(
                    f"file {file_id}: {loss.kind} of attempt {loss.attempt} (event {loss.id},"
                    f" token {_short(loss.lease_token)}) followed by nothing: row "
                    f"{row.status}, {row.attempts} attempts, lease {_short(row.lease_token)}"
                )
    return verdict


def tenants_within_cap(history: History, rules: Rules) -> Verdict:
    """Every tenant below its cap at every claim: replaying the claims (`claimed`
    events, with the row's tenant) and every end of an attempt in id order, a claim of
    a tenant's row never finds `tenant_cap` of its rows in flight already."""
    unit = f"claims of a tenant's row (cap {rules.tenant_cap})"
    verdict = Verdict("every tenant below its cap at every claim", 0, unit)
    if rules.tenant_cap < 1:
        verdict.unit = "claims (no cap configured: nothing to check)"
        return verdict
    # file id -> (its tenant, the token it is processing under)
    holder: dict[int, tuple[str, str | None]] = {}
    claims = 0
    for event in history.events:
        if event.kind == "claimed":
            claims += 1
            if event.tenant is None:
                continue  # no tenant: not capped
            if event.file_id in holder:  # an expired lease reclaimed: no more in flight
                holder[event.file_id] = (event.tenant, event.lease_token)
                continue
            verdict.checked += 1
            busy = sorted(f for f, (t, _) in holder.items() if t == event.tenant)
            if len(busy) >= rules.tenant_cap:
                verdict.violations.append(
                    f"tenant {event.tenant!r}: file {event.file_id} claimed (event {event.id})"
                    f" with {len(busy)} in flight already: files {busy[:6]}"
                )
            holder[event.file_id] = (event.tenant, event.lease_token)
        elif event.kind == "delete_requested" or (
            event.kind in ENDS_ATTEMPT
            and holder.get(event.file_id, ("", None))[1] == event.lease_token
        ):
            holder.pop(event.file_id, None)  # its own attempt ended (a death may not)
    if claims == 0 and any(r.tenant for r in history.rows.values()):
        verdict.violations.append("a cap is configured but the history records no claims")
    return verdict


# The supervisor learns that a job started a moment before the handler's first line;
# events carry their transaction's start. What a timeout's measure may lose to both.
TIMEOUT_SLACK_S = 0.2
# Events that charge an attempt's end to its worker: a death (when its fence held, a
# `retry` or `rejected` of the same token follows) and a timeout kill (recorded only
# when its fence held).
CHARGED_MOVES = ("retry", "rejected", "rederive_rejected")


def _charges(history: History) -> list[Event]:
    """The worker_died and timeout events that cost their attempt."""
    moved: dict[str | None, int] = {}  # token -> id of its last fenced move
    for event in history.events:
        if event.kind in CHARGED_MOVES:
            moved[event.lease_token] = event.id
    return [
        e
        for e in history.events
        if e.kind == "timeout" or (e.kind == "worker_died" and moved.get(e.lease_token, 0) > e.id)
    ]


def _first_starts(history: History) -> dict[str, DeriveStart]:
    """token -> its attempt's first derive start."""
    out: dict[str, DeriveStart] = {}
    for start in history.derive_starts or ():
        out.setdefault(start.token, start)
    return out


def charges_only_started(history: History, rules: Rules) -> Verdict:
    """A crash or a timeout costs only the attempt that was running (DESIGN.md
    "Pipelined worker"): each charged `worker_died` or `timeout` names an attempt whose
    derive had started (the handler's log), and a timeout came `job_timeout` after that
    start at the earliest: the wait behind another job is not the job's time."""
    verdict = Verdict("a crash or timeout charges only a started attempt", 0, "charges")
    charges = _charges(history)
    if history.derive_starts is None:
        verdict.unit = "charges (no derive log kept)"
        if charges:
            verdict.violations.append(f"{len(charges)} charge(s) and no derive log to judge them")
        return verdict
    started = _first_starts(history)
    for charge in charges:
        verdict.checked += 1
        what = (
            f"file {charge.file_id}: {charge.kind} charged attempt {charge.attempt} "
            f"(event {charge.id}, token {_short(charge.lease_token)})"
        )
        start = started.get(charge.lease_token or "")
        if start is None:
            verdict.violations.append(f"{what}, whose derive never started")
            continue
        if charge.kind != "timeout" or not rules.job_timeout or charge.at is None:
            continue
        own = charge.at - start.at
        if own < rules.job_timeout - TIMEOUT_SLACK_S:
            verdict.violations.append(
                f"{what} {own:.2f}s after its derive started (job_timeout {rules.job_timeout:g}s)"
            )
    return verdict


def _excused(start: DeriveStart, history: History, rules: Rules) -> str | None:
    """Why an attempt that derived may have left no event: the run killed its process
    after the derive began, or the database went away before its lease ran out."""
    for pid, at in history.disruptions.kills:
        if pid == start.pid and at >= start.at:
            return "killed"
    for began, ended in history.disruptions.outages:
        if ended >= start.at and (not rules.lease or began <= start.at + rules.lease):
            return "outage"
    return None


def derives_accounted_for(history: History, rules: Rules) -> Verdict:
    """Every derive has its outcome on record, so a file is derived again only for a
    recorded cause: each attempt derives once (the handler's log), and each attempt
    that derived left an event of its token (committed, failed, released, lost its
    lease, timed out, died) unless the run killed its process or took the database
    away meanwhile. A commit whose answer was lost is not a cause: it is sent again.
    And every commit's derive is in the log (the log is whole)."""
    verdict = Verdict("every derive has a recorded outcome", 0, "derive starts")
    if history.derive_starts is None:
        verdict.unit = "derive starts (no derive log kept: nothing to check)"
        return verdict
    outcomes: dict[str, list[Event]] = {}
    for event in history.events:
        if event.kind != "claimed" and event.lease_token is not None:
            outcomes.setdefault(event.lease_token, []).append(event)
    counts = Counter(s.token for s in history.derive_starts)
    later: dict[int, list[DeriveStart]] = {}
    for start in history.derive_starts:
        later.setdefault(start.job, []).append(start)
    for token, start in _first_starts(history).items():
        verdict.checked += counts[token]
        if start.job < 0:
            verdict.violations.append(f"a derive by pid {start.pid}: the handler found no job")
            continue
        what = f"job {start.job}: attempt {start.attempt} (token {_short(token)}, pid {start.pid})"
        if counts[token] > 1:
            verdict.violations.append(f"{what} derived {counts[token]} times")
        if outcomes.get(token) or _excused(start, history, rules):
            continue
        again = [s.attempt for s in later[start.job] if s.token != token and s.at > start.at]
        tail = f"; derived again by attempt(s) {again}" if again else ""
        verdict.violations.append(f"{what} derived and left no outcome{tail}")
    for event in history.events:
        if event.kind in ("ready", "rederived") and event.lease_token not in counts:
            verdict.violations.append(
                f"file {event.file_id}: {event.kind} by attempt {event.attempt} (token "
                f"{_short(event.lease_token)}) whose derive is not in the log"
            )
    return verdict


# A final transition's event -> the webhook event its outbox rows carry.
ANNOUNCED = {
    "ready": "file.ready",
    "rejected": "file.rejected",
    "exhausted": "file.rejected",
    "deleted": "file.deleted",
    "rederived": "file.rederived",
}


def final_transitions_announced(history: History, rules: Rules) -> Verdict:
    """With an endpoint configured, every final transition of a file (its event:
    ready, rejected or exhausted, deleted, and a re-derivation's swap) has its outbox
    row for each endpoint subscribed to that event and the file's tenant, written with
    it (DESIGN.md "Webhooks"). That each final state has its event is
    `final_states_stay_final`'s."""
    verdict = Verdict("every final transition has its outbox rows", 0, "events x endpoints")
    if not any(not e.removed for e in history.endpoints):
        verdict.unit = "events x endpoints (no endpoint configured: nothing to check)"
        return verdict
    events = Counter(
        (e.file_id, ANNOUNCED[e.kind])
        for e in history.events
        if e.kind in ANNOUNCED
        and (row := history.rows.get(e.file_id)) is not None
        and row.rederive_of is None
    )
    rows = Counter((d.file_id, d.event, d.endpoint) for d in history.deliveries)
    for (file_id, kind), n in sorted(events.items()):
        tenant = history.rows[file_id].tenant
        for endpoint in history.endpoints:
            if not endpoint.subscribed(kind, tenant):
                continue
            verdict.checked += n
            have = rows[(file_id, kind, endpoint.name)]
            if have < n:
                verdict.violations.append(
                    f"file {file_id}: {n} {kind} event(s), {have} outbox row(s) for "
                    f"endpoint {endpoint.name}"
                )
    return verdict


# --------------------------------------------------------------------------- objects


def objects_owned(history: History, rules: Rules) -> Verdict:
    """Every stored object (each version of each key) is an original or a variant of a
    row that is not deleted, in the write-ahead registry, or retired for deletion."""
    verdict = Verdict("every stored object has an owner", 0, "object versions")
    referenced = _referenced(history)
    referenced_keys = {key for key, _ in referenced}
    for obj in history.objects:
        verdict.checked += 1
        if (obj.key, obj.version) in referenced:
            continue
        if _registered(obj.key, history.pending_keys | history.retired_keys):
            continue
        why = (
            "another version of the key is referenced"
            if obj.key in referenced_keys
            else ("referenced by no row or variant")
        )
        verdict.violations.append(
            f"{obj.key} version {obj.version}: {why}, not in pending_objects, not retired"
        )
    return verdict


def objects_present(history: History, rules: Rules) -> Verdict:
    """Every variant and original a row still references is in the store, by version."""
    verdict = Verdict("every referenced object is stored", 0, "references")
    stored = {(o.key, o.version) for o in history.objects}
    for key, version in sorted(_referenced(history)):
        verdict.checked += 1
        if (key, version) not in stored:
            verdict.violations.append(f"{key} version {version}: referenced, not stored")
    return verdict


def _registered(key: str, registry: set[str]) -> bool:
    """`key` is in the registry, itself or under a registered prefix (`…/`)."""
    if key in registry:
        return True
    parts = key.split("/")
    return any("/".join(parts[:n]) + "/" in registry for n in range(1, len(parts)))


def _referenced(history: History) -> set[tuple[str, str]]:
    """(key, version) of every original and variant of a row not deleted. An original
    rejected as missing_original is referenced by nothing (it never was there)."""
    out: set[tuple[str, str]] = set()
    for row in history.rows.values():
        if row.status == "deleted" or row.rederive_of is not None:
            continue
        if row.original_version is not None and row.error_code != "missing_original":
            out.add((row.original_key, row.original_version))
    for variant in history.variants:
        owner = history.rows.get(variant.file_id)
        if owner is not None and owner.status != "deleted":
            out.add((variant.key, variant.version))
    return out


# --------------------------------------------------------------------------- the end


def no_live_rows(history: History, rules: Rules) -> Verdict:
    """Nothing left live after the drain: no row pending, queued, processing or
    deleting (the run's sweep finished deletions)."""
    verdict = Verdict("no live row left after the drain", 0, "rows")
    for row in history.rows.values():
        verdict.checked += 1
        if row.status in LIVE:
            job = f" (re-derivation of {row.rederive_of})" if row.rederive_of else ""
            verdict.violations.append(
                f"file {row.id}{job}: {row.status}, {row.attempts} attempts, tenant "
                f"{row.tenant!r}, lease {_short(row.lease_token)}"
            )
    return verdict


INVARIANTS: tuple[Callable[[History, Rules], Verdict], ...] = (
    ready_has_configured_set,
    variants_from_their_commit,
    one_commit_per_attempt,
    final_states_stay_final,
    attempts_within_cap,
    losses_followed_up,
    charges_only_started,
    derives_accounted_for,
    final_transitions_announced,
    tenants_within_cap,
    objects_owned,
    objects_present,
    no_live_rows,
)


def check(history: History, rules: Rules) -> list[Verdict]:
    return [invariant(history, rules) for invariant in INVARIANTS]


def table_rows(verdicts: list[Verdict]) -> list[tuple[str, str, str]]:
    """(invariant, PASS/FAIL, what it checked and what broke it) for bench's tables."""
    return [(v.name, "PASS" if v.ok else "FAIL", v.summary()) for v in verdicts]


# A chaos run reads a worker's process title a moment before it kills it: the job the
# title names may have ended in between.
TITLE_LAG_S = 0.5
# The supervisor records a death a moment after it: one a moment before an outage meets
# the database gone.
RECORD_LAG_S = 1.0


def unrecorded_deaths(
    kills: list[tuple[int, float]],
    events: list[tuple[int, str, float]],
    outages: Sequence[tuple[float, float]] = (),
) -> list[int]:
    """The jobs of busy workers killed (job id, when) with neither a `worker_died` event
    after the kill (the supervisor returns a dead worker's jobs at once: DESIGN.md) nor
    an end of their attempt just before it (the title was a moment old). A kill while
    the database was away (`outages`: start, end), or a moment before, is not one: the
    death cannot be recorded then, and the job waits for its lease
    (`losses_followed_up`, `no_live_rows`)."""
    missing = []
    for job, killed_at in kills:
        if any(began - RECORD_LAG_S <= killed_at <= ended for began, ended in outages):
            continue
        mine = [(kind, at) for file_id, kind, at in events if file_id == job]
        died = any(kind == "worker_died" and at >= killed_at - TITLE_LAG_S for kind, at in mine)
        ended = any(
            kind in ENDS_ATTEMPT and killed_at - TITLE_LAG_S <= at <= killed_at + TITLE_LAG_S
            for kind, at in mine
        )
        if not (died or ended):
            missing.append(job)
    return missing


__all__ = [
    "INVARIANTS",
    "Rules",
    "StoredObject",
    "Verdict",
    "check",
    "table_rows",
    "unrecorded_deaths",
]
