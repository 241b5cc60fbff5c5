"""What commands print: `derivd similar` gives each near-duplicate's distance; `config
show` hides a webhook URL's query (a receiver's token) as `webhooks list` does; a value
outside a setting's choices is named in its error."""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

from configs import write_ini
from fixtures.work import claim_one, commit_one

from derivd.handlers.base import Analysis
from derivd.queue.db import QueueDB, StoredVariant

RunCli = Callable[..., subprocess.CompletedProcess[str]]
SECRET = "whsec_" + base64.b64encode(b"derivd shown values test secret!").decode()
VARIANT = StoredVariant("thumb", "derived/1/t/thumb.webp", "v1", "ab" * 32, 32, 24)


def ini(tmp_path: Path, dsn: str, **more: dict[str, str]) -> Path:
    return write_ini(tmp_path / "derivd.ini", {
        "database": {"dsn": dsn},
        "storage": {"backend": "fs", "root": tmp_path / "objects"},
        "webhook:app": {"url": "https://hooks.example.com/in?token=s3cr3t-t0ken",
                        "secret": SECRET},
        **more,
    })  # fmt: skip


def ready(queue: QueueDB, dhash: int) -> int:
    file_id = queue.enqueue_one("originals/a", "v1")
    job = claim_one(queue, lease_s=30, max_attempts=3)
    analysis = Analysis(width=10, height=10, format="jpeg", frames=1, has_alpha=False,
                        colour="#102030", placeholder="A" * 24, dhash=dhash)  # fmt: skip
    assert job is not None and commit_one(queue, job, [VARIANT], analysis)
    return file_id


def test_similar_prints_each_distance(
    dsn: str, queue: QueueDB, tmp_path: Path, run_cli: RunCli
) -> None:
    path = ini(tmp_path, dsn)
    first = ready(queue, 0b1111)
    one_off = ready(queue, 0b0111)
    three_off = ready(queue, 0b0001)
    ready(queue, -1)  # 60 bits away
    text = run_cli("-c", str(path), "similar", str(first))
    assert text.stdout.splitlines() == [f"{one_off}\t1 bit", f"{three_off}\t3 bits"], text.stderr
    answer = json.loads(run_cli("-c", str(path), "similar", str(first), "--json").stdout)
    assert (answer["similar"], answer["distances"]) == ([one_off, three_off], [1, 3])


def test_config_show_hides_a_webhook_urls_query(dsn: str, tmp_path: Path, run_cli: RunCli) -> None:
    shown = run_cli("-c", str(ini(tmp_path, dsn)), "config", "show")
    assert shown.returncode == 0, shown.stderr
    assert "url = https://hooks.example.com/in?…" in shown.stdout
    assert "s3cr3t-t0ken" not in shown.stdout + shown.stderr


def test_a_value_outside_the_choices_is_named(dsn: str, tmp_path: Path, run_cli: RunCli) -> None:
    path = ini(tmp_path, dsn, logging={"format": "yaml"})
    checked = run_cli("-c", str(path), "config", "check")
    assert checked.returncode == 2
    assert "[logging] format: 'yaml' is not one of: text, json" in checked.stderr
