"""The chaos run's checks: its own expectations, then every invariant of the state machine
over the history it left (harness.invariants)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter

from derivd.config_load import load_config
from harness import derive_log
from harness.chaos_faults import Tally
from harness.chaos_webhooks import checks as webhook_checks
from harness.chaos_world import CONTENT_CODES, World
from harness.history import load as load_history
from harness.invariants import Rules, unrecorded_deaths
from harness.invariants import check as check_history
from harness.listing import s3_objects


@dataclasses.dataclass
class Check:
    name: str
    ok: bool
    detail: str


def check_all(
    world: World, expected: dict[int, tuple[str, str]], tally: Tally, exit_code: int | None
) -> list[Check]:
    """The run's own expectations (each input's outcome, the freeze fenced, a clean
    stop, the bytes of every ready variant) and then the history checker's invariants
    (harness.invariants), which know nothing of this run but its configuration."""
    checks: list[Check] = []
    rows = {
        r[0]: r
        for r in world.query("SELECT id, status, error_code, derived_key FROM archive_files")
    }
    events = world.query("SELECT file_id, kind, lease_token::text FROM archive_events")
    kinds = Counter(kind for _, kind, _ in events)

    wrong: list[str] = []
    for file_id, (case, want) in expected.items():
        row = rows.get(file_id)
        got = None if row is None else ("ready" if row[1] == "ready" else row[2])
        if got != want:
            wrong.append(f"{file_id}:{case} want {want} got {got}")
    n_valid = sum(1 for _, w in expected.values() if w == "ready")
    checks.append(
        Check(
            "valid -> ready, hostile -> its content code",
            not wrong and len(rows) == len(expected),
            f"{len(rows)} rows, {n_valid} valid, {len(expected) - n_valid} hostile; "
            f"wrong: {wrong[:6]}",
        )
    )
    bad_codes = [
        f"{i}:{r[2]}"
        for i, r in rows.items()
        if r[1] == "rejected"
        and expected.get(i, ("", ""))[1] != "ready"
        and r[2] not in CONTENT_CODES
    ]
    checks.append(
        Check("hostile rejected with a content code", not bad_codes, f"others: {bad_codes[:6]}")
    )
    checks.append(check_variant_bytes(world))

    lost = {tok for _, kind, tok in events if kind == "lease_lost"}
    unfenced = [t for t in tally.stunt_tokens if t not in lost]
    checks.append(
        Check(
            "frozen worker's late write fenced (lease_lost)",
            tally.stunts > 0 and not unfenced,
            f"{tally.stunts} freeze(s); without lease_lost: {unfenced}",
        )
    )
    checks.append(
        Check(
            "supervisor survived, exit 0 after SIGTERM",
            not tally.supervisor_died and exit_code == 0,
            f"exit code {exit_code}",
        )
    )
    checks.append(_check_deaths_recorded(world, tally))
    checks += history_checks(world, tally)
    checks += [Check(*c) for c in webhook_checks(world.query, world.hooks)]
    tally.notes.append("events: " + ", ".join(f"{k}={n}" for k, n in sorted(kinds.items())))
    return checks


def _check_deaths_recorded(world: World, tally: Tally) -> Check:
    jobs = [job for job, _ in tally.busy_kills]
    events = world.query(
        "SELECT file_id, kind, extract(epoch FROM at)::float8 FROM archive_events"
        " WHERE file_id = ANY(%s)",
        (jobs,),
    )
    missing = unrecorded_deaths(
        tally.busy_kills, [(int(f), str(k), float(a)) for f, k, a in events], tally.outages
    )
    return Check(
        "each busy worker killed: worker_died for its job",
        not missing,
        f"{len(tally.busy_kills)} busy kill(s); without worker_died: {missing}",
    )


def history_checks(world: World, tally: Tally) -> list[Check]:
    """Every invariant of the state machine over what the run left (events, tables, the
    bucket's listing), under the rules of the run's own configuration. The violations
    of a failing one go to the notes in full."""
    rules = Rules.from_config(load_config(world.ini))
    starts = derive_log.read(world.derive_log)
    history = load_history(
        world.dsn, s3_objects(world.s3(), world.bucket), starts, tally.disruptions()
    )
    verdicts = check_history(history, rules)
    for verdict in verdicts:
        tally.notes += [f"{verdict.name}: {v}" for v in verdict.violations[:40]]
    slow = {k for k, s in world.slow.items() if s}
    keys = {r.id: r.original_key for r in history.rows.values()}
    stretched = sum(1 for s in starts if s.attempt == 1 and keys.get(s.job) in slow)
    logged = Check(
        "the derive log was kept",
        bool(starts),
        f"{len(starts)} derive starts by {len({s.pid for s in starts})} processes, "
        f"{stretched} first derives for 50-90 % of job_timeout",
    )
    return [logged] + [Check(f"history: {v.name}", v.ok, v.summary()) for v in verdicts]


def check_variant_bytes(world: World) -> Check:
    """Each ready variant's object, read by its version, has the sha256 recorded."""
    client = world.s3()
    variants = world.query(
        "SELECT v.file_id, v.name, v.key, v.version, v.sha256 FROM archive_variants AS v"
        " JOIN archive_files AS f ON f.id = v.file_id WHERE f.status = 'ready'"
    )
    problems: list[str] = []
    for file_id, name, key, version, digest in variants:
        try:
            body = client.get_object(Bucket=world.bucket, Key=key, VersionId=version)
            data = body["Body"].read()
        except Exception as error:
            problems.append(f"{file_id}/{name}: GET failed ({type(error).__name__})")
            continue
        if hashlib.sha256(data).hexdigest() != digest:
            problems.append(f"{file_id}/{name}: sha256 differs")
    return Check(
        "ready variants' bytes, by version, match their sha256",
        not problems,
        f"{len(variants)} variants read; {problems[:6]}",
    )
