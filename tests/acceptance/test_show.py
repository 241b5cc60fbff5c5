"""`derivd show ID` as an operator runs it: a file derived by the real `derivd run --burst`
(the fault-injection handler reports a chosen analysis), then its row, analysis, variants
and events as text and as one JSON object; an unknown id is one line and exit 1."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from subprocess import CompletedProcess
from typing import Any

import pytest
from fixtures.analysis import PHOTO
from fixtures.cli import support_pythonpath
from fixtures.work import claim_one, commit_one

from derivd.queue.db import QueueDB, StoredVariant
from derivd.storage.fs import FsStorage

RunCli = Callable[..., CompletedProcess[str]]


@pytest.fixture
def cli(run_cli: RunCli, dsn: str, fs_root: Path, tmp_path: Path) -> Callable[..., Any]:
    """`derivd ARGS` on the test database and store, the fault-injection handler as the
    backend, from an empty directory."""
    env = {
        "DERIVD_DATABASE_DSN": dsn,
        "DERIVD_STORAGE_BACKEND": "fs",
        "DERIVD_STORAGE_ROOT": str(fs_root),
        "DERIVD_DERIVE_BACKEND": "faulthandlers:Script",
        "DERIVD_SUPERVISOR_WORKERS": "1",
        "DERIVD_SUPERVISOR_STATE_DIR": str(tmp_path / "state"),
        "DERIVD_QUEUE_MAX_ATTEMPTS": "1",
        "PYTHONPATH": support_pythonpath(os.environ),
    }

    def call(*args: str) -> CompletedProcess[str]:
        result = run_cli(*args, env=env, cwd=tmp_path)
        assert "Traceback" not in result.stderr, result.stderr
        return result

    return call


def queue_script(dsn: str, fs_root: Path, script: str) -> int:
    storage = FsStorage(fs_root)
    key = "originals/script"
    with QueueDB.open(dsn) as queue:
        (file_id,) = queue.enqueue([(key, storage.put(key, script.encode(), "text/plain"))])
    return file_id


def test_show_a_derived_file_with_its_analysis_and_timeline(
    cli: Callable[..., CompletedProcess[str]], dsn: str, fs_root: Path
) -> None:
    derived = queue_script(dsn, fs_root, f"analysis {json.dumps(asdict(PHOTO))}")
    failed = queue_script(dsn, fs_root, "no-such-fault")
    waiting = queue_script(dsn, fs_root, "ok")
    run = cli("run", "--burst")
    assert run.returncode == 0, run.stderr
    # Queued after the burst: never claimed.
    assert cli("retry", str(failed)).returncode == 0

    text = cli("show", str(derived))
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == f"file {derived}: ready"
    for expected in (
        "size         3024x4032 (as displayed)",
        "format       heic, 1 frame, no alpha",
        "colour       #8a7f6e",
        f"placeholder  {PHOTO.placeholder} (ThumbHash, base64)",
        f"dhash        {PHOTO.dhash & (2**64 - 1):016x} ({PHOTO.dhash})",
        "variants: none",
        "events (1)",
    ):
        assert f"  {expected}" in lines or expected in lines, (expected, text.stdout)
    assert lines[-1].split()[2:] == ["ready", "1", "-", "-"]

    shown = json.loads(cli("show", "--json", str(derived)).stdout)
    assert set(shown) == {"row", "analysis", "variants", "events"}
    assert shown["analysis"] == asdict(PHOTO)
    assert (shown["row"]["id"], shown["row"]["status"], shown["row"]["attempts"]) == (
        derived,
        "ready",
        1,
    )
    assert not any(k in shown["row"] for k in ("original_width", "original_dhash"))
    assert shown["variants"] == []
    assert [(e["kind"], e["attempt"]) for e in shown["events"]] == [("ready", 1)]

    retried = json.loads(cli("show", "--json", str(failed)).stdout)
    assert retried["analysis"] is None and retried["row"]["status"] == "queued"
    assert [e["kind"] for e in retried["events"]] == ["rejected", "operator_retry"]
    assert retried["events"][0]["error_code"] == "processing_failed"
    assert retried["events"][1]["actor"].startswith("cli:")
    text = cli("show", str(failed)).stdout
    assert "analysis: none" in text and "operator_retry" in text

    assert json.loads(cli("show", "--json", str(waiting)).stdout)["row"]["status"] == "ready"


def test_show_lists_every_variant(
    cli: Callable[..., CompletedProcess[str]], dsn: str, fs_root: Path
) -> None:
    file_id = queue_script(dsn, fs_root, "ok")
    with QueueDB.open(dsn) as queue:
        job = claim_one(queue, lease_s=60, max_attempts=3)
        assert job is not None
        variants = [
            StoredVariant(
                "large", f"derived/{file_id}/t/large.webp", "v1", "cd" * 32, 800, 600, bytes=4096
            ),
            # As a host of a release before migration 0019 commits it: no size recorded.
            StoredVariant(
                "thumb", f"derived/{file_id}/t/thumb.avif", "v2", "ab" * 32, 200, 150, "avif"
            ),
        ]
        assert commit_one(queue, job, variants)
    lines = cli("show", str(file_id)).stdout.splitlines()
    start = lines.index("variants (2)")
    header = ["name", "format", "size", "bytes", "sha256", "key", "version"]
    assert lines[start + 1].split() == header
    assert lines[start + 2].split() == [
        "large", "webp", "800x600", "4096", "cd" * 8, f"derived/{file_id}/t/large.webp", "v1"
    ]  # fmt: skip
    assert lines[start + 3].split()[:4] == ["thumb", "avif", "200x150", "-"]
    assert f"primary      derived/{file_id}/t/large.webp  800x600  sha256 {'cd' * 32}" in "\n".join(
        lines
    )
    shown = json.loads(cli("show", "--json", str(file_id)).stdout)
    assert [(v["name"], v["format"], v["version"], v["bytes"]) for v in shown["variants"]] == [
        ("large", "webp", "v1", 4096),
        ("thumb", "avif", "v2", None),
    ]
    # The row keeps its own columns named like an analysis field (the primary's size).
    assert (shown["row"]["width"], shown["row"]["height"]) == (800, 600)


def test_show_an_unknown_id_is_one_line_and_exit_1(
    cli: Callable[..., CompletedProcess[str]],
) -> None:
    for args in (("show", "424242"), ("show", "--json", "424242")):
        result = cli(*args)
        assert result.returncode == 1
        assert result.stdout == ""
        assert result.stderr.splitlines() == ["derivd: no file with id 424242"]
    assert cli("show", "0").returncode == 2  # click's usage error: ids start at 1


def test_show_never_creates_a_cluster(run_cli: RunCli, tmp_path: Path) -> None:
    """From a directory where nothing ran (empty [database] dsn: the embedded cluster),
    `show` says there is no database, in one line, and leaves the directory empty."""
    result = run_cli("show", "1", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("derivd: no embedded database under "), line
    assert result.stdout == "" and list(tmp_path.iterdir()) == []
