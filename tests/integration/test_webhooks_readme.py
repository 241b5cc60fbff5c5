"""docs/integrating.md's Python webhook receiver works as written: served by a WSGI server on
127.0.0.1, it verifies what derivd's deliverer POSTs and handles each event once,
replays (the same webhook-id) included."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest
from fixtures.delivering import SECRET, delivering, endpoint
from fixtures.work import claim_one, commit_one
from helpers import sql, wait_for

from derivd.queue.db import QueueDB, StoredVariant

PAGE = Path(__file__).resolve().parents[2] / "docs" / "integrating.md"
VARIANT = StoredVariant("thumb", "derived/1/t/thumb.webp", "v1", "ab" * 32, 32, 24)


class Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        return None


def receiver_module(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)
    (code,) = [b for b in blocks if "def derivd_events(" in b]
    monkeypatch.setenv("APP_WEBHOOK_SECRET", SECRET)
    module: dict[str, Any] = {}
    exec(compile(code, "integrating.md", "exec"), module)
    return module


def test_the_readme_receiver_verifies_and_handles_each_event_once(
    dsn: str, queue: QueueDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = receiver_module(monkeypatch)
    handled: list[dict[str, Any]] = []
    app["handle"] = handled.append  # the page's handle() prints; the test keeps them
    server = make_server("127.0.0.1", 0, app["derivd_events"], handler_class=Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/"
    try:
        with delivering(dsn, endpoint(url, retry_horizon=600)):
            ids = []
            for _ in range(3):
                ids.append(queue.enqueue_one("originals/a", "v1"))
                job = claim_one(queue, lease_s=30, max_attempts=3)
                assert job is not None and commit_one(queue, job, [VARIANT])
            delivered = "SELECT count(*) AS n FROM derivd_deliveries WHERE status = 'delivered'"
            wait_for(lambda: sql(dsn, delivered)[0]["n"] == 3, "3 deliveries")
            assert queue.replay_deliveries(ids=ids) == 3  # the same webhook-ids again
            attempts = "SELECT sum(attempts) AS n FROM derivd_deliveries WHERE status = 'delivered'"
            wait_for(lambda: sql(dsn, attempts)[0]["n"] == 6, "the replays delivered")
    finally:
        server.shutdown()
        server.server_close()
    assert sorted(e["data"]["file_id"] for e in handled) == ids
    assert len(app["seen"]) == 3
