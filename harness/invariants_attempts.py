"""The invariants of attempts: within the cap, every loss followed up, tenants within their
cap, charges only for started derives, every derive accounted for, every final move announced."""

from __future__ import annotations

from collections import Counter

from harness.history import FINAL, DeriveStart, Event, History
from harness.invariants_base import ENDS_ATTEMPT, LOSSES, Rules, Verdict, short

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
                f"(event {event.id}, token {short(event.lease_token)})"
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
                    f" token {short(loss.lease_token)}) followed by nothing: row "
                    f"{row.status}, {row.attempts} attempts, lease {short(row.lease_token)}"
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
            f"(event {charge.id}, token {short(charge.lease_token)})"
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
        what = f"job {start.job}: attempt {start.attempt} (token {short(token)}, pid {start.pid})"
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
                f"{short(event.lease_token)}) whose derive is not in the log"
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
