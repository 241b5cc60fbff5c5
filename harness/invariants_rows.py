"""The invariants of what each row ends as: its variants (the configured set, from the commit
that made them), one commit per attempt, final states that stay final, nothing left live."""

from __future__ import annotations

from harness.history import LIVE, Event, History
from harness.invariants_base import Rules, Verdict, short

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
                f"file {variant.file_id} {variant.slot}: token {short(variant.lease_token)}, "
                f"installed by {short(commit)}"
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
                f"token {short(token)}: {len(events)} ready events (ids {[e.id for e in events]})"
            )
    for file_id, events in by_row.items():
        if len({e.lease_token for e in events}) > 1:
            verdict.violations.append(
                f"file {file_id}: ready by {len(events)} attempts "
                f"{[(e.attempt, short(e.lease_token)) for e in events]}"
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
                    f"{event.attempt}, token {short(event.lease_token)}) while {phase}"
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
                f"{row.tenant!r}, lease {short(row.lease_token)}"
            )
    return verdict
