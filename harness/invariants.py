"""The state machine's invariants (DESIGN.md "The state machine", "The lease protocol"),
checked over a whole `History`: each a pure function that says how much it checked and
describes every violation precisely enough to find it in the tables.

Written from the design, not from derivd's code: they need only the records a run left.
`check` runs them all; `table_rows` prints them the way bench/ prints its tables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from harness.history import History, StoredObject
from harness.invariants_attempts import (
    attempts_within_cap,
    charges_only_started,
    derives_accounted_for,
    final_transitions_announced,
    losses_followed_up,
    tenants_within_cap,
)
from harness.invariants_base import ENDS_ATTEMPT, Rules, Verdict
from harness.invariants_objects import objects_owned, objects_present
from harness.invariants_rows import (
    final_states_stay_final,
    no_live_rows,
    one_commit_per_attempt,
    ready_has_configured_set,
    variants_from_their_commit,
)

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
