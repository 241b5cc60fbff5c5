"""The state machine's invariants (DESIGN.md "The state machine", "The lease protocol"),
checked over a whole `History`: each a pure function that says how much it checked and
describes every violation precisely enough to find it in the tables.

Written from the design, not from derivd's code: they need only the records a run left.
`check` runs them all; `table_rows` prints them the way bench/ prints its tables.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from harness.history import FINAL, LIVE, Event, History, StoredObject

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

    @classmethod
    def from_config(cls, config: Config) -> Rules:
        """The rules a derivd configuration sets: its cap, its variant set (with the
        fingerprint of the spec each slot is made by) and its tenant cap."""
        from derivd.fingerprint import configured_set

        return cls(
            max_attempts=config.queue.max_attempts,
            slots=configured_set(config.derive_spec(), config.derive.backend),
            tenant_cap=config.queue.max_in_flight_per_tenant,
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


def unrecorded_deaths(
    kills: list[tuple[int, float]], events: list[tuple[int, str, float]]
) -> list[int]:
    """The jobs of busy workers killed (job id, when) with neither a `worker_died` event
    after the kill (the supervisor returns a dead worker's jobs at once: DESIGN.md) nor
    an end of their attempt just before it (the title was a moment old)."""
    missing = []
    for job, killed_at in kills:
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
