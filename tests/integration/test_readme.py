"""docs/integrating.md's examples for upload APIs run as written (on the test database and
store)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import psycopg
import pytest
from fixtures.work import claim_one, commit_one

from derivd import client
from derivd.queue.db import QueueDB, StoredVariant

PAGE = Path(__file__).resolve().parents[2] / "docs" / "integrating.md"


def python_block(containing: str) -> str:
    """The page's one ```python block that contains `containing`."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)
    (block,) = [b for b in blocks if containing in b]
    return block


def test_the_upload_example_lets_derivd_refuse_an_unversioned_bucket() -> None:
    """It indexed put["VersionId"]: a KeyError before derivd could say what is wrong."""
    block = python_block("def upload(environ, start_response)")
    assert 'put["VersionId"]' not in block
    assert 'client.enqueue(db, key, put.get("VersionId"))' in block
    with pytest.raises(client.MissingVersion, match="versioned bucket"):
        client.enqueue(None, "originals/x", {}.get("VersionId"))  # type: ignore[arg-type]


def test_the_fs_store_example_stores_a_version_and_finds_each_variant(
    dsn: str, fs_root: Path
) -> None:
    code = python_block("FsStorage(").replace('"/srv/derivd/objects"', repr(str(fs_root)))
    app: dict[str, Any] = {}
    exec(compile(code, "integrating.md", "exec"), app)  # the page's module, as an app has it
    store = app["store"]
    with psycopg.connect(dsn, autocommit=True) as db:
        file_id = app["save_upload"](db, b"original bytes")
        with QueueDB.open(dsn) as queue:
            row = queue.file_row(file_id)
            assert row is not None and row["status"] == "queued"
            assert store.get(row["original_key"], row["original_version"]) == b"original bytes"
            # What a worker does: store a variant under its attempt's key, commit it.
            job = claim_one(queue, lease_s=60, max_attempts=3)
            assert job is not None and job.id == file_id
            key = f"derived/{file_id}/{job.token}/thumb.webp"
            version = store.put(key, b"webp bytes", "image/webp")
            assert commit_one(queue, job, [StoredVariant("thumb", key, version, "ab" * 32, 8, 6)])
        (variant,) = client.result(db, file_id).variants
    path = app["variant_path"](variant)
    assert path.read_bytes() == b"webp bytes" and path.suffix == ".webp"
    assert path.is_relative_to(fs_root)
    url = app["variant_url"](variant)
    assert url == f"/media/{key}.versions/{version}.webp"
