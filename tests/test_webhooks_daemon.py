"""`derivd run` with `[webhook:NAME]` sections (issue 29): its child POSTs what the
outbox holds to a real receiver that verifies with `standardwebhooks`; the supervisor
itself never does (its process makes no HTTP call: the deliverer is a child process of
its own); SIGHUP adds and removes endpoints. Direct and through PgBouncer."""

from __future__ import annotations

import base64
import signal
import subprocess
from collections.abc import Iterator
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
                                          " WHERE name = 'app'"), "app removed",
                     detail=log)  # fmt: skip
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
