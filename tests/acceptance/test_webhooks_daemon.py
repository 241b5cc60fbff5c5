"""`derivd run` with `[webhook:NAME]` sections: its child POSTs what the
outbox holds to a real receiver that verifies with `standardwebhooks`; the supervisor
itself never does (its process makes no HTTP call: the deliverer is a child process of
its own); SIGHUP adds and removes endpoints. Direct and through PgBouncer."""

from __future__ import annotations

import base64
import json
import re
import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from configs import write_ini
from fixtures.cli import derivd_command
from fixtures.pgbouncer import DIRECT_FOR
from fixtures.receiver import Receiver, receiving
from helpers import proc_title, sql, stop_process, wait_for
from imagegen import jpeg

from derivd.client import enqueue
from derivd.storage.fs import FsStorage

pytestmark = pytest.mark.pooler
RunCli = Callable[..., subprocess.CompletedProcess[str]]

SECRET = "whsec_" + base64.b64encode(b"derivd daemon test secret 32 b!!").decode()


def daemon_ini(
    root: Path, dsn: str, hooks: dict[str, str], derive: dict[str, str] | None = None
) -> Path:
    sections: dict[str, dict[str, Any]] = {
        "database": {"dsn": dsn, "listen_dsn": DIRECT_FOR.get(dsn, "")},
        "storage": {"backend": "fs", "root": root / "objects"},
        "supervisor": {"workers": 1, "state_dir": root / "state"},
        "derive": derive or {"backend": "noop"},
    }
    for name, url in hooks.items():
        sections[f"webhook:{name}"] = {"url": url, "secret": SECRET, "retry_base": "0.2"}
    return write_ini(root / "derivd.ini", sections)


@contextmanager
def daemon(root: Path, ini: Path) -> Iterator[subprocess.Popen[str]]:
    with (root / "derivd.log").open("w") as log:
        proc = subprocess.Popen([*derivd_command(), "-c", str(ini), "run"],
                                stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
        try:
            yield proc
        finally:
            stop_process(proc)


def queue_file(root: Path, dsn: str, data: bytes = b"x") -> int:
    import psycopg

    version = FsStorage(root / "objects").put("originals/a", data, "image/x")
    with psycopg.connect(dsn, autocommit=True) as conn:
        return enqueue(conn, "originals/a", version)


def got(receiver: Receiver, file_id: int) -> list[str]:
    return [r.webhook_id for r in receiver.unique().values()
            if r.payload["data"]["file_id"] == file_id]  # fmt: skip


def test_the_daemon_delivers_and_sighup_adds_and_removes_endpoints(
    dsn: str, tmp_path: Path
) -> None:
    log = lambda: (tmp_path / "derivd.log").read_text(errors="replace")  # noqa: E731
    with receiving(SECRET) as app, receiving(SECRET) as audit:
        ini = daemon_ini(tmp_path, dsn, {"app": app.url})
        with daemon(tmp_path, ini) as proc:
            first = queue_file(tmp_path, dsn)
            wait_for(lambda: got(app, first), "file.ready at the app", detail=log)
            [event] = [r for r in app.unique().values() if r.payload["data"]["file_id"] == first]
            assert event.payload["type"] == "file.ready"
            assert event.payload["data"]["status"] == "ready"
            assert "webhooks" not in proc_title(proc.pid)  # the POSTs are a child's

            daemon_ini(tmp_path, dsn, {"app": app.url, "audit": audit.url})
            proc.send_signal(signal.SIGHUP)
            wait_for(lambda: sql(dsn, "SELECT 1 FROM derivd_webhook_endpoints"
                                      " WHERE name = 'audit'"), "audit subscribed",
                     detail=log)  # fmt: skip
            second = queue_file(tmp_path, dsn)
            wait_for(lambda: got(app, second) and got(audit, second), "both endpoints",
                     detail=log)  # fmt: skip

            daemon_ini(tmp_path, dsn, {"audit": audit.url})
            proc.send_signal(signal.SIGHUP)
            wait_for(lambda: not sql(dsn, "SELECT 1 FROM derivd_webhook_endpoints"
                                          " WHERE name = 'app' AND removed_at IS NULL"),
                     "app removed", detail=log)  # fmt: skip
            third = queue_file(tmp_path, dsn)
            wait_for(lambda: got(audit, third), "the third file at audit", detail=log)
        assert got(app, third) == []
    assert all(r.verified for r in app.answered() + audit.answered())
    assert not sql(dsn, "SELECT 1 FROM derivd_deliveries WHERE endpoint = 'app'"
                        " AND file_id = %s", (third,))  # fmt: skip


def test_each_variant_in_the_payload_carries_its_stored_objects_size(
    dsn: str, tmp_path: Path
) -> None:
    log = lambda: (tmp_path / "derivd.log").read_text(errors="replace")  # noqa: E731
    derive = {"backend": "pillow", "variants": "preview:64, thumb:32"}
    with receiving(SECRET) as app:
        with daemon(tmp_path, daemon_ini(tmp_path, dsn, {"app": app.url}, derive)):
            file_id = queue_file(tmp_path, dsn, jpeg(96, 72))
            wait_for(lambda: got(app, file_id), "file.ready at the app", detail=log)
    [event] = app.unique().values()
    variants = event.payload["data"]["variants"]
    assert sorted(v["name"] for v in variants) == ["preview", "thumb"]
    storage = FsStorage(tmp_path / "objects")
    sizes = {v["key"]: len(storage.get(v["key"], v["version"])) for v in variants}
    assert {v["key"]: v["bytes"] for v in variants} == sizes
    assert len(set(sizes.values())) == 2  # each variant its own size, not one for all


def undelivered(dsn: str, endpoint: str) -> list[dict[str, Any]]:
    return sql(dsn, "SELECT id, status FROM derivd_deliveries WHERE endpoint = %s"
                    " AND status IN ('pending', 'delivering')", (endpoint,))  # fmt: skip


def ended(dsn: str, endpoint: str) -> list[dict[str, Any]]:
    return sql(dsn, "SELECT file_id, status, last_error FROM derivd_deliveries"
                    " WHERE endpoint = %s ORDER BY id", (endpoint,))  # fmt: skip


def test_an_endpoint_removed_by_sighup_gets_nothing_more_its_rows_end_failed(
    dsn: str, tmp_path: Path
) -> None:
    log = lambda: (tmp_path / "derivd.log").read_text(errors="replace")  # noqa: E731
    with receiving(SECRET) as app, receiving(SECRET) as gone:
        gone.default = "500"  # its delivery stays undelivered, retried
        ini = daemon_ini(tmp_path, dsn, {"app": app.url, "gone": gone.url})
        with daemon(tmp_path, ini) as proc:
            first = queue_file(tmp_path, dsn)
            wait_for(lambda: got(app, first) and gone.answered("500"), "app got it, gone refused",
                     detail=log)  # fmt: skip
            daemon_ini(tmp_path, dsn, {"app": app.url})
            proc.send_signal(signal.SIGHUP)
            wait_for(lambda: not undelivered(dsn, "gone"), "gone's delivery ended", detail=log)
            asked = len(gone.answered())
            second = queue_file(tmp_path, dsn)
            wait_for(lambda: got(app, second), "the second file at app", detail=log)
        assert len(gone.answered()) == asked  # nothing POSTed to it once its rows ended
    assert ended(dsn, "gone") == [
        {"file_id": first, "status": "failed", "last_error": "endpoint removed"}]  # fmt: skip
    assert "removed=gone" in log()


def test_a_restart_without_any_section_ends_the_rows_and_they_replay_when_it_is_back(
    dsn: str, tmp_path: Path, run_cli: RunCli
) -> None:
    log = lambda: (tmp_path / "derivd.log").read_text(errors="replace")  # noqa: E731
    with receiving(SECRET) as gone:
        gone.default = "500"
        with daemon(tmp_path, daemon_ini(tmp_path, dsn, {"gone": gone.url})):
            file_id = queue_file(tmp_path, dsn)
            wait_for(lambda: gone.answered("500"), "gone refused it", detail=log)
        [refused] = {r.webhook_id for r in gone.answered("500")}
        ini = daemon_ini(tmp_path, dsn, {})  # no [webhook:*] section: no deliverer at all
        with daemon(tmp_path, ini):
            wait_for(lambda: not undelivered(dsn, "gone"), "gone's delivery ended", detail=log)
            status = json.loads(run_cli("-c", str(ini), "status", "--json").stdout)
        [shown] = status["webhooks"]
        assert (shown["name"], shown["removed"], shown["backlog"], shown["failed_kept"]) == (
            "gone", True, 0, 1)  # fmt: skip
        assert ended(dsn, "gone") == [
            {"file_id": file_id, "status": "failed", "last_error": "endpoint removed"}]  # fmt: skip

        gone.default = "ok"
        ini = daemon_ini(tmp_path, dsn, {"gone": gone.url})
        with daemon(tmp_path, ini):
            wait_for(lambda: sql(dsn, "SELECT 1 FROM derivd_webhook_endpoints WHERE name ="
                                      " 'gone' AND removed_at IS NULL"), "gone configured again",
                     detail=log)  # fmt: skip
            replay = run_cli("-c", str(ini), "webhooks", "replay", "--failed", "--endpoint", "gone")
            assert replay.returncode == 0, replay.stderr
            wait_for(lambda: got(gone, file_id), "the replay at gone", detail=log)
    assert got(gone, file_id) == [refused]  # the same webhook-id: receivers dedupe it


def test_run_burst_delivers_what_its_commits_queued_before_it_exits(
    dsn: str, tmp_path: Path, run_cli: RunCli
) -> None:
    """`run --burst` used to exit once the files were done, their events still queued.
    Now its last deliverer POSTs them (a retry due soon included) before it ends."""
    with receiving(SECRET) as app:
        app.script = ["500"]  # the first POST is refused: its retry comes within a second
        ini = daemon_ini(tmp_path, dsn, {"app": app.url})
        ids = [queue_file(tmp_path, dsn) for _ in range(3)]
        run = run_cli("-c", str(ini), "run", "--burst", timeout=120)
        assert run.returncode == 0, run.stderr
        # Right as it exits, with nothing waited for here.
        assert sorted(r.payload["data"]["file_id"] for r in app.unique().values()) == ids
        [refused] = app.answered("500")
        assert refused.webhook_id in app.unique()  # retried under its id, then delivered
    assert {r["status"] for r in ended(dsn, "app")} == {"delivered"}
    assert "left " not in run.stderr


def test_run_burst_names_the_deliveries_it_leaves_for_later(
    dsn: str, tmp_path: Path, run_cli: RunCli
) -> None:
    with receiving(SECRET) as app:
        app.default, app.retry_after = "429", "300"  # due again past the burst's wait
        ini = daemon_ini(tmp_path, dsn, {"app": app.url})
        queue_file(tmp_path, dsn)
        run = run_cli("-c", str(ini), "run", "--burst", timeout=120)
        assert run.returncode == 0, run.stderr
        assert len(app.answered("429")) == 1
    assert [r["status"] for r in ended(dsn, "app")] == ["pending"]
    (line,) = [line for line in run.stderr.splitlines() if line.startswith("derivd: left ")]
    assert re.fullmatch(
        r"derivd: left 1 webhook delivery pending for endpoint app, the next due in "
        r"4m5\ds \(at \d\d:\d\d:\d\d\): run `derivd run --burst` again then, or `derivd run`",
        line,
    ), line
