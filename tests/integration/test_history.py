"""The history checker (harness.invariants) can fail: small histories made by the real
worker on a real database and store, then broken the way a bug would break them, each
reported by its invariant, precisely. And the unbroken history passes every invariant,
so the chaos runs' PASS means something.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import imagegen
import pytest
from configs import make_config
from fixtures.work import claim_one, make_worker, run_one
from helpers import sql

from derivd.queue.db import QueueDB
from derivd.storage.base import derived_key, new_original_key
from derivd.storage.fs import FsStorage
from harness.history import load
from harness.invariants import Rules, Verdict, check, unrecorded_deaths
from harness.listing import fs_objects

MAX_ATTEMPTS = 3


@dataclass
class World:
    dsn: str
    store: FsStorage
    rules: Rules
    ids: list[int]

    def verdicts(self) -> dict[str, Verdict]:
        history = load(self.dsn, fs_objects(self.store.root))
        return {v.name: v for v in check(history, self.rules)}

    def failing(self) -> dict[str, list[str]]:
        return {name: v.violations for name, v in self.verdicts().items() if not v.ok}


@pytest.fixture
def world(dsn: str, fs_root: Path) -> World:
    """Three files made ready by the real worker (pillow, two variants, fs store)."""
    config = make_config(
        dsn,
        fs_root=fs_root,
        derive={"backend": "pillow", "variants": "preview:320, thumb:64"},
        queue={"max_attempts": MAX_ATTEMPTS},
    )
    store = FsStorage(fs_root)
    originals = []
    for _ in range(3):
        key = new_original_key()
        originals.append((key, store.put(key, imagegen.jpeg(), "image/jpeg")))
    with QueueDB.open(dsn, role="test") as queue:
        ids = queue.enqueue(originals)
    worker = make_worker(config, dsn, store)
    while run_one(worker) is not None:
        pass
    assert [r["status"] for r in sql(dsn, "SELECT status FROM archive_files")] == ["ready"] * 3
    return World(dsn, store, Rules.from_config(config), ids)


def only(world: World, name: str) -> list[str]:
    """The violations of invariant `name`, which must be failing."""
    failing = world.failing()
    assert name in failing, f"{name!r} passed; failing: {failing}"
    return failing[name]


def test_a_history_made_by_the_worker_passes_every_invariant(world: World) -> None:
    verdicts = world.verdicts()
    assert [name for name, v in verdicts.items() if not v.ok] == [], verdicts
    checked = {name: v.checked for name, v in verdicts.items()}
    assert checked["ready files hold exactly the configured variant set"] == 3
    assert checked["variants belong to the commit that installed them"] == 6
    assert checked["every stored object has an owner"] == 9  # 3 originals, 6 variants
    assert checked["no two ready commits for one attempt"] == 3


def test_a_ready_file_missing_a_variant_is_reported(world: World) -> None:
    file_id = world.ids[1]
    sql(world.dsn, "DELETE FROM archive_variants WHERE file_id = %s AND name = 'thumb'", (file_id,))
    violations = only(world, "ready files hold exactly the configured variant set")
    assert violations == [f"file {file_id}: missing ['thumb.webp']"]


def test_a_variant_made_by_another_spec_is_reported(world: World) -> None:
    file_id = world.ids[0]
    sql(
        world.dsn,
        "UPDATE archive_variants SET fingerprint = 'feedfacefeedface'"
        " WHERE file_id = %s AND name = 'preview'",
        (file_id,),
    )
    (violation,) = only(world, "ready files hold exactly the configured variant set")
    assert violation.startswith(f"file {file_id}: made by another spec: ['preview.webp")


def test_an_attempt_over_the_cap_is_reported(world: World) -> None:
    file_id = world.ids[2]
    sql(
        world.dsn,
        "UPDATE archive_files SET attempts = %s WHERE id = %s",
        (MAX_ATTEMPTS + 1, file_id),
    )
    violations = only(world, "attempts never above the cap")
    assert violations == [f"file {file_id}: {MAX_ATTEMPTS + 1} attempts (ready)"]


def test_a_stranded_lease_lost_is_reported(world: World) -> None:
    """A loss recorded while the row stays processing under that very token, with no
    attempt after it: the file waits for nothing."""
    original = new_original_key()
    with QueueDB.open(world.dsn, role="test") as queue:
        (file_id,) = queue.enqueue([(original, world.store.put(original, b"x", "image/jpeg"))])
        job = claim_one(queue, lease_s=30, max_attempts=MAX_ATTEMPTS)
    assert job is not None and job.id == file_id
    sql(
        world.dsn,
        "INSERT INTO archive_events (file_id, kind, attempt, lease_token)"
        " VALUES (%s, 'lease_lost', 1, %s)",
        (file_id, str(job.token)),
    )
    (violation,) = only(world, "every lost attempt followed by a new one or a final state")
    assert violation.startswith(f"file {file_id}: lease_lost of attempt 1 (event ")
    assert f"token {str(job.token)[:8]}) followed by nothing: row processing" in violation
    assert only(world, "no live row left after the drain") == [
        f"file {file_id}: processing, 1 attempts, tenant None, lease {str(job.token)[:8]}"
    ]


def test_an_orphan_object_is_reported(world: World) -> None:
    key = derived_key(world.ids[0], uuid.uuid4(), "thumb")
    version = world.store.put(key, b"put by an attempt that registered nothing", "image/webp")
    violations = only(world, "every stored object has an owner")
    assert violations == [
        f"{key} version {version}: referenced by no row or variant, not in pending_objects,"
        " not retired"
    ]


def test_an_object_in_the_write_ahead_registry_or_retired_has_an_owner(world: World) -> None:
    pending = derived_key(world.ids[0], uuid.uuid4(), "thumb")
    under_prefix = derived_key(world.ids[2], token := uuid.uuid4(), "thumb")
    retired = derived_key(world.ids[1], uuid.uuid4(), "thumb")
    for key in (pending, under_prefix, retired):
        world.store.put(key, b"bytes", "image/webp")
    for key, file_id in (
        (pending, world.ids[0]),
        (f"derived/{world.ids[2]}/{token}/", world.ids[2]),
    ):
        sql(
            world.dsn,
            "INSERT INTO pending_objects (key, file_id, lease_token) VALUES (%s, %s, %s)",
            (key, file_id, str(uuid.uuid4())),
        )
    sql(
        world.dsn,
        "INSERT INTO derivd_retired_objects (key, file_id) VALUES (%s, %s)",
        (retired, world.ids[1]),
    )
    assert world.failing() == {}


def test_a_second_version_of_a_variant_key_is_reported(world: World) -> None:
    (row,) = sql(
        world.dsn, "SELECT key FROM archive_variants WHERE file_id = %s LIMIT 1", (world.ids[0],)
    )
    version = world.store.put(row["key"], b"a retried PUT stored twice", "image/webp")
    assert only(world, "every stored object has an owner") == [
        f"{row['key']} version {version}: another version of the key is referenced,"
        " not in pending_objects, not retired"
    ]


def test_a_referenced_object_missing_from_the_store_is_reported(world: World) -> None:
    (row,) = sql(
        world.dsn,
        "SELECT key, version FROM archive_variants WHERE file_id = %s AND name = 'preview'",
        (world.ids[0],),
    )
    world.store.path_of(row["key"], row["version"]).unlink()
    assert only(world, "every referenced object is stored") == [
        f"{row['key']} version {row['version']}: referenced, not stored"
    ]


def test_a_second_ready_commit_of_one_attempt_is_reported(world: World) -> None:
    file_id = world.ids[0]
    sql(
        world.dsn,
        "INSERT INTO archive_events (file_id, kind, attempt, lease_token)"
        " SELECT file_id, kind, attempt, lease_token FROM archive_events"
        " WHERE file_id = %s AND kind = 'ready'",
        (file_id,),
    )
    (violation,) = only(world, "no two ready commits for one attempt")
    assert violation.endswith("2 ready events (ids " + violation.split("(ids ")[1])
    # and the state machine: ready is final, a second commit is a move out of it
    (move,) = only(world, "every row's events follow the state machine")
    assert move.startswith(f"file {file_id}: ready (event ") and move.endswith("while ready")


def test_a_commit_after_deletion_is_reported(world: World) -> None:
    """Deletion revokes the right to commit: a `ready` after `delete_requested`."""
    original = new_original_key()
    with QueueDB.open(world.dsn, role="test") as queue:
        (file_id,) = queue.enqueue([(original, world.store.put(original, b"x", "image/jpeg"))])
        job = claim_one(queue, lease_s=30, max_attempts=MAX_ATTEMPTS)
        assert job is not None
        queue.request_delete([file_id], actor="test")
    sql(
        world.dsn,
        "INSERT INTO archive_events (file_id, kind, attempt, lease_token)"
        " VALUES (%s, 'ready', 1, %s)",
        (file_id, str(job.token)),
    )
    moves = only(world, "every row's events follow the state machine")
    assert any(
        m.startswith(f"file {file_id}: ready (event ") and m.endswith("while deleting")
        for m in moves
    ), moves


def test_a_variant_of_another_attempt_is_reported(world: World) -> None:
    file_id = world.ids[2]
    stranger = str(uuid.uuid4())
    sql(
        world.dsn,
        "UPDATE archive_variants SET lease_token = %s WHERE file_id = %s AND name = 'thumb'",
        (stranger, file_id),
    )
    (violation,) = only(world, "variants belong to the commit that installed them")
    assert violation.startswith(f"file {file_id} thumb.webp: token {stranger[:8]}, installed by ")


def claimed(dsn: str, file_id: int, tenant: str | None, token: uuid.UUID) -> None:
    """A `claimed` event as a capped claim records it."""
    sql(
        dsn,
        "INSERT INTO archive_events (file_id, kind, attempt, lease_token, tenant)"
        " VALUES (%s, 'claimed', 1, %s, %s)",
        (file_id, str(token), tenant),
    )


def ended(dsn: str, file_id: int, kind: str, token: uuid.UUID) -> None:
    sql(
        dsn,
        "INSERT INTO archive_events (file_id, kind, attempt, lease_token) VALUES (%s, %s, 1, %s)",
        (file_id, kind, str(token)),
    )


def test_a_claim_over_its_tenants_cap_is_reported(world: World) -> None:
    """Cap 1: file a2 claimed while a1 of the same tenant is in flight; b's and the
    untenanted claims, a1's reclaim after its lease expired and a3's claim after a1's
    release are all within the cap."""
    world.rules = Rules(world.rules.max_attempts, world.rules.slots, tenant_cap=1)
    a1, a2, a3, b, none = 9001, 9002, 9003, 9004, 9005
    t = {n: uuid.uuid4() for n in range(7)}
    claimed(world.dsn, a1, "a", t[0])
    claimed(world.dsn, b, "b", t[1])
    claimed(world.dsn, none, None, t[2])
    claimed(world.dsn, a1, "a", t[3])  # its expired lease, reclaimed
    claimed(world.dsn, a2, "a", t[4])  # the violation
    ended(world.dsn, a2, "ready", t[4])
    ended(world.dsn, a1, "released", t[3])
    claimed(world.dsn, a3, "a", t[5])
    verdict = world.verdicts()["every tenant below its cap at every claim"]
    assert verdict.checked == 4  # a1, b, a2, a3: no tenant and a reclaim are no new claim
    (violation,) = verdict.violations
    assert violation.startswith(f"tenant 'a': file {a2} claimed (event ")
    assert violation.endswith(f"with 1 in flight already: files [{a1}]")


def test_a_cap_without_recorded_claims_is_reported(world: World) -> None:
    """The check cannot pass by finding nothing to check."""
    sql(world.dsn, "UPDATE archive_files SET tenant = 'a'")
    world.rules = Rules(world.rules.max_attempts, world.rules.slots, tenant_cap=1)
    assert only(world, "every tenant below its cap at every claim") == [
        "a cap is configured but the history records no claims"
    ]


def test_capped_claims_record_their_tenant_and_pass(world: World) -> None:
    """The real claim under a cap writes the `claimed` events the tenant check replays:
    cap 1, tenants a, a, b and no tenant, claimed one call at a time."""
    world.rules = Rules(world.rules.max_attempts, world.rules.slots, tenant_cap=1)
    originals = []
    for _ in range(4):
        key = new_original_key()
        originals.append((key, world.store.put(key, b"x", "image/jpeg")))
    with QueueDB.open(world.dsn, role="test") as queue:
        ids = queue.enqueue(originals)
        for file_id, tenant in zip(ids, ["a", "a", "b", None], strict=True):
            sql(world.dsn, "UPDATE archive_files SET tenant = %s WHERE id = %s", (tenant, file_id))
        claims = [
            queue.claim_many(limit=1, lease_s=30, max_attempts=MAX_ATTEMPTS, tenant_cap=1)
            for _ in range(4)
        ]
    got = sorted(job.id for jobs in claims for job in jobs)
    assert got == sorted([ids[0], ids[2], ids[3]])  # a's second row waits: a is at its cap
    events = sql(
        world.dsn, "SELECT file_id, tenant, attempt FROM archive_events WHERE kind = 'claimed'"
    )
    assert sorted((e["file_id"], e["tenant"], e["attempt"]) for e in events) == sorted(
        [(ids[0], "a", 1), (ids[2], "b", 1), (ids[3], None, 1)]
    )
    verdict = world.verdicts()["every tenant below its cap at every claim"]
    assert (verdict.checked, verdict.violations) == (2, [])


def test_a_rejected_rederivation_is_its_files_event_not_a_violation(world: World) -> None:
    """A re-derivation's rejection is recorded on its file (`rederive_rejected`, the file
    keeps its set); its job row stays `rejected` without an event of its own."""
    file_id = world.ids[0]
    (row,) = sql(
        world.dsn,
        "SELECT original_key, original_version FROM archive_files WHERE id = %s",
        (file_id,),
    )
    token = str(uuid.uuid4())
    sql(
        world.dsn,
        "INSERT INTO derivd_rederivations (file_id, status, attempts, original_key,"
        " original_version, error_code) VALUES (%s, 'rejected', 1, %s, %s, 'processing_failed')",
        (file_id, row["original_key"], row["original_version"]),
    )
    sql(
        world.dsn,
        "INSERT INTO archive_events (file_id, kind, attempt, lease_token, error_code)"
        " VALUES (%s, 'rederive_rejected', 1, %s, 'processing_failed')",
        (file_id, token),
    )
    assert world.failing() == {}


def test_a_busy_worker_killed_must_leave_worker_died_or_have_just_ended_its_job() -> None:
    kills = [(1, 100.0), (2, 100.0), (3, 100.0), (4, 100.0)]
    events = [
        (1, "worker_died", 100.2),  # the supervisor returned it
        (2, "ready", 99.8),  # committed as the title was read
        (3, "ready", 90.0),  # an earlier attempt's: the kill left no record
        (4, "lease_lost", 130.0),  # waited out its lease: not at once
    ]
    assert unrecorded_deaths(kills, events) == [3, 4]
    assert unrecorded_deaths([], events) == []
