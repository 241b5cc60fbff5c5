"""The original's analysis from the handler to the row and back: the worker
hands it to the fenced commit, `derivd.client.result()` returns it as `Result.original`
once the file is ready, `derivd.client.similar` finds near-duplicates by dhash, and the
database refuses what the worker would refuse (migration 0013)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import psycopg
import pytest
from configs import make_config
from faulthandlers import Script
from fixtures.analysis import PHOTO
from fixtures.work import claim_one, commit_one, make_worker, run_one
from helpers import sql

from derivd import analysis_rules, client
from derivd.handlers.base import Analysis
from derivd.queue.db import QueueDB
from derivd.storage.fs import FsStorage
from derivd.worker import Worker

LONG = 60.0
COLUMNS = [f"original_{name}" for name in asdict(PHOTO)]


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as c:
        yield c


def stored(dsn: str, file_id: int) -> dict[str, Any]:
    (row,) = sql(dsn, f"SELECT {', '.join(COLUMNS)} FROM archive_files WHERE id = %s", (file_id,))
    return row


def distance(a: int, b: int) -> int:
    """Bits in which two signed 64-bit dhashes differ."""
    return ((a ^ b) & (2**64 - 1)).bit_count()


def signed(value: int) -> int:
    """The low 64 bits of `value` as a signed 64-bit integer (a dhash)."""
    unsigned = value & (2**64 - 1)
    return unsigned - 2**64 if unsigned >= 2**63 else unsigned


def ready(queue: QueueDB, conn: psycopg.Connection[Any], original: Analysis | None) -> int:
    file_id = client.enqueue(conn, "originals/x", "v1")
    job = claim_one(queue, lease_s=LONG, max_attempts=3)
    assert job is not None and job.id == file_id
    assert commit_one(queue, job, [], original)
    return file_id


# --------------------------------------------------------------------------- the rules


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"width": 0}, "width"),
        ({"frames": -1}, "frames"),
        ({"height": 2.5}, "integers"),
        ({"format": "HEIC"}, "format"),
        ({"format": "x" * 17}, "format"),
        ({"colour": "red"}, "colour"),
        ({"colour": "#12345"}, "colour"),
        ({"placeholder": "not base64!"}, "placeholder"),
        ({"placeholder": "A" * 65}, "placeholder"),
        ({"has_alpha": 1}, "has_alpha"),
        ({"dhash": 2**63}, "dhash"),
        ({"dhash": "0"}, "dhash"),
    ],
)
def test_a_malformed_analysis_names_its_field(change: dict[str, Any], field: str) -> None:
    assert analysis_rules.problem(PHOTO) is None
    found = analysis_rules.problem(replace(PHOTO, **change))
    assert found is not None and field in found


def test_the_colour_is_stored_in_lower_case() -> None:
    upper = replace(PHOTO, colour="#8A7F6E")
    assert analysis_rules.problem(upper) is None
    assert analysis_rules.normalised(upper) == PHOTO


# Values the Python rules and the table CHECK must judge alike.
SAMPLES = [
    ({}, True),
    ({"colour": "#ABCDEF"}, False),  # the worker lower-cases it first; the row holds lower
    ({"colour": "#abcdeg"}, False),
    ({"width": 0}, False),
    ({"frames": 0}, False),
    ({"format": "image/heic"}, False),
    ({"placeholder": "YJqGPQw7sFlslqhFafSE+Q6oJ1h2iHB2Rw"}, True),
    ({"placeholder": "YJqGPQw7sFlslqhFafSE+Q6oJ1h2iHB2Rw=="}, True),
    ({"placeholder": "short"}, False),
    ({"placeholder": "A" * 65}, False),
    ({"dhash": -(2**63)}, True),
]


@pytest.mark.parametrize(("change", "accepted"), SAMPLES)
def test_the_database_judges_an_analysis_as_the_worker_does(
    dsn: str, change: dict[str, Any], accepted: bool
) -> None:
    candidate = replace(PHOTO, **change)
    assert (analysis_rules.problem(candidate) is None and candidate.colour.islower()) is accepted
    (row,) = sql(dsn, "INSERT INTO archive_files (original_key) VALUES ('k') RETURNING id")
    assign = ", ".join(f"{c} = %s" for c in COLUMNS)
    update = f"UPDATE archive_files SET {assign} WHERE id = %s"
    values = (*asdict(candidate).values(), row["id"])
    if accepted:
        sql(dsn, update, values)
    else:
        with pytest.raises(psycopg.errors.CheckViolation, match="archive_files_original_check"):
            sql(dsn, update, values)


def test_the_analysis_is_all_or_nothing_on_the_row(dsn: str) -> None:
    (row,) = sql(dsn, "INSERT INTO archive_files (original_key) VALUES ('k') RETURNING id")
    with pytest.raises(psycopg.errors.CheckViolation):
        sql(dsn, "UPDATE archive_files SET original_width = 10 WHERE id = %s", (row["id"],))


# --------------------------------------------------------------------------- commit, result


def test_the_commit_stores_the_analysis_and_result_returns_it(
    dsn: str, conn: psycopg.Connection[Any], queue: QueueDB
) -> None:
    file_id = client.enqueue(conn, "originals/x", "v1")
    assert client.result(conn, file_id).original is None  # queued
    job = claim_one(queue, lease_s=LONG, max_attempts=3)
    assert job is not None
    assert client.result(conn, file_id).original is None  # processing
    assert commit_one(queue, job, [], PHOTO)
    assert stored(dsn, file_id) == {f"original_{k}": v for k, v in asdict(PHOTO).items()}
    done = client.result(conn, file_id)
    assert done.status == "ready"
    assert done.original == client.Original(**asdict(PHOTO))
    assert [f.name for f in client.Original.__dataclass_fields__.values()] == list(asdict(PHOTO))


def test_a_handler_that_analyses_nothing_commits_no_analysis(
    dsn: str, conn: psycopg.Connection[Any], queue: QueueDB
) -> None:
    file_id = ready(queue, conn, None)
    assert set(stored(dsn, file_id).values()) == {None}
    assert client.result(conn, file_id).original is None


def test_a_file_no_longer_ready_shows_no_analysis(
    conn: psycopg.Connection[Any], queue: QueueDB
) -> None:
    file_id = ready(queue, conn, PHOTO)
    assert queue.request_delete([file_id], actor="test") == [file_id]
    assert client.result(conn, file_id).original is None


def test_a_lost_lease_stores_no_analysis(
    dsn: str, conn: psycopg.Connection[Any], queue: QueueDB
) -> None:
    file_id = client.enqueue(conn, "originals/x", "v1")
    job = claim_one(queue, lease_s=LONG, max_attempts=3)
    assert job is not None
    assert queue.request_delete([file_id], actor="test") == [file_id]
    assert not commit_one(queue, job, [], PHOTO)
    assert set(stored(dsn, file_id).values()) == {None}


# --------------------------------------------------------------------------- the worker


def script_worker(dsn: str, fs_root: Path) -> Worker:
    config = make_config(dsn, fs_root=fs_root, derive={"backend": "faulthandlers:Script"})
    return make_worker(config, dsn, FsStorage(fs_root), Script())


def enqueue_script(worker: Worker, conn: psycopg.Connection[Any], script: str) -> int:
    key = "originals/script"
    version = worker.storage.put(key, script.encode(), "text/plain")
    return client.enqueue(conn, key, version)


def test_the_worker_commits_the_handlers_analysis(
    dsn: str, fs_root: Path, conn: psycopg.Connection[Any]
) -> None:
    worker = script_worker(dsn, fs_root)
    shouting = replace(PHOTO, colour=PHOTO.colour.upper())
    file_id = enqueue_script(worker, conn, f"analysis {json.dumps(asdict(shouting))}")
    result = run_one(worker)
    worker.close()
    assert result is not None and (result.job.id, result.outcome) == (file_id, "ready")
    assert client.result(conn, file_id).original == client.Original(**asdict(PHOTO))


def test_a_malformed_analysis_fails_its_job_not_the_commit(
    dsn: str, fs_root: Path, conn: psycopg.Connection[Any]
) -> None:
    worker = script_worker(dsn, fs_root)
    bad = enqueue_script(worker, conn, f"analysis {json.dumps(asdict(PHOTO) | {'width': 0})}")
    good = enqueue_script(worker, conn, f"analysis {json.dumps(asdict(PHOTO))}")
    outcomes = [run_one(worker), run_one(worker)]
    worker.close()
    assert [(r.job.id, r.outcome, r.code) for r in outcomes if r] == [
        (bad, "rejected", "processing_failed"),
        (good, "ready", None),
    ]
    assert set(stored(dsn, bad).values()) == {None}


# --------------------------------------------------------------------------- similar


def test_similar_finds_near_duplicates_nearest_first(
    conn: psycopg.Connection[Any], queue: QueueDB
) -> None:
    base = PHOTO.dhash

    def with_hash(dhash: int) -> int:
        return ready(queue, conn, replace(PHOTO, dhash=dhash))

    def flip(bits: int) -> int:
        return signed(base ^ bits)

    me = with_hash(base)
    same = with_hash(base)
    three_bits = with_hash(flip(0b111 << 61))  # the sign bit among them
    flipped = with_hash(flip(2**64 - 1))
    six_bits = with_hash(flip(0b111111))
    seven_bits = with_hash(flip(0b1111111))
    far = with_hash(flip(0xFFFF_0000))
    gone = with_hash(base)
    queue.request_delete([gone], actor="test")
    waiting = client.enqueue(conn, "originals/y", "v1")  # no dhash yet
    assert distance(base, flip(0b111 << 61)) == 3
    assert distance(base, flip(2**64 - 1)) == 64

    assert client.similar(conn, me) == [same, three_bits, six_bits]
    assert client.similar(conn, me, max_distance=7) == [same, three_bits, six_bits, seven_bits]
    assert client.similar(conn, me, max_distance=0) == [same]
    assert far not in client.similar(conn, me, max_distance=15)
    assert flipped in client.similar(conn, me, max_distance=64)
    assert me not in client.similar(conn, me, max_distance=64)
    assert gone not in client.similar(conn, me, max_distance=64)
    assert client.similar(conn, waiting) == []


def test_similar_refuses_an_unknown_id_and_an_impossible_distance(
    conn: psycopg.Connection[Any],
) -> None:
    with pytest.raises(client.UnknownFile):
        client.similar(conn, 12345)
    with pytest.raises(ValueError, match="0-64"):
        client.similar(conn, 1, max_distance=65)
    for limit in (0, 10_001):
        with pytest.raises(ValueError, match="limit must be within 1-10,000"):
            client.similar(conn, 1, limit=limit)


def test_similar_answers_at_most_its_limit(conn: psycopg.Connection[Any], queue: QueueDB) -> None:
    """derivd_similar had no LIMIT: at a wide distance it shipped the whole table."""
    me = ready(queue, conn, PHOTO)
    same = [ready(queue, conn, PHOTO) for _ in range(4)]
    assert client.similar(conn, me, max_distance=64) == same
    assert client.similar(conn, me, max_distance=64, limit=2) == same[:2]

    def direct(sql: str) -> list[int]:
        return [r[0] for r in conn.execute(sql, {"id": me})]  # type: ignore[call-overload]

    assert direct("SELECT derivd_similar(%(id)s, 64, 3)") == same[:3]
    assert direct("SELECT derivd_similar(%(id)s, 64, 0)") == []
    assert direct("SELECT derivd_similar(%(id)s, 64)") == same  # the two-argument form: 100


def test_the_readme_similar_sql_answers_as_the_client_does(
    conn: psycopg.Connection[Any], queue: QueueDB
) -> None:
    """docs/integrating.md, "From any other language", gives the statements for other languages: as
    written ($1 the file, $2 the distance), each finds what client.similar finds."""
    readme = (Path(__file__).resolve().parents[2] / "docs" / "integrating.md").read_text("utf-8")
    block = readme.split("-- similar:", 1)[1].split("```", 1)[0]
    code = "\n".join(line.split("--")[0] for line in block.splitlines()[1:])
    statements = [s.replace("$1", "%(id)s").replace("$2", "%(max)s") for s in code.split(";")]
    statements = [s for s in statements if s.strip()]
    assert len(statements) == 2
    me = ready(queue, conn, PHOTO)
    near = ready(queue, conn, replace(PHOTO, dhash=PHOTO.dhash ^ 0b11))
    ready(queue, conn, replace(PHOTO, dhash=PHOTO.dhash ^ 0xFFFF))
    for statement in statements:
        found = [r[0] for r in conn.execute(statement, {"id": me, "max": 6})]  # type: ignore[call-overload]
        assert found == client.similar(conn, me) == [near], statement


def test_the_optional_band_index_gives_the_same_answers(
    conn: psycopg.Connection[Any], queue: QueueDB
) -> None:
    """docs/integrating.md's CREATE INDEX, as written: derivd_similar then probes it (up to 7 bits)
    and finds exactly what the scan finds."""
    readme = (Path(__file__).resolve().parents[2] / "docs" / "integrating.md").read_text("utf-8")
    create = readme.split("```sql\nCREATE INDEX CONCURRENTLY archive_files_dhash_bands", 1)[1]
    create = "CREATE INDEX CONCURRENTLY archive_files_dhash_bands" + create.split("```", 1)[0]
    rng = random.Random(19)
    base = [rng.getrandbits(64) - 2**63 for _ in range(40)]
    ids = [ready(queue, conn, replace(PHOTO, dhash=h)) for h in base]
    for h in base[:20]:  # near copies: 1-8 bits flipped, across every band
        flips = sum(1 << b for b in rng.sample(range(64), rng.randint(1, 8)))
        unsigned = (h ^ flips) & (2**64 - 1)
        ready(
            queue, conn, replace(PHOTO, dhash=unsigned - 2**64 if unsigned >= 2**63 else unsigned)
        )
    scans = {(i, d): client.similar(conn, i, d) for i in ids[:20] for d in (0, 3, 6, 7, 8)}
    assert any(scans.values())
    conn.execute(create)  # type: ignore[arg-type]
    conn.execute("SET enable_seqscan = off")  # as a large table would choose
    plan = "\n".join(
        r[0]
        for r in conn.execute(
            "EXPLAIN SELECT f.id FROM archive_files AS f"
            " WHERE derivd_dhash_bands(f.original_dhash) && derivd_dhash_probes(1)"
            " AND f.original_dhash IS NOT NULL"
        )
    )
    assert "archive_files_dhash_bands" in plan, plan
    assert {key: client.similar(conn, *key) for key in scans} == scans
