"""The chaos run's webhooks (issue 29): a receiver process on 127.0.0.1 that verifies
every request with the `standardwebhooks` library and logs it (tests/support/fixtures/receiver.py),
restarted mid-run; the supervisor's delivering child SIGKILLed; and the checks, read from
the receiver's log and the tables alone:

- every ready or rejected file's event was received (verified, 2xx) at least once;
- every duplicate of an event carries its webhook-id: one id per (file, event), one body
  per id;
- no event for a commit that did not happen: each received file.ready names a file that
  is ready, each file.rejected one that is rejected, with the row's error code;
- every signature verifies.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from derivd.osproc import children_of

SECRET = "whsec_" + base64.b64encode(b"derivd chaos webhook secret 32 b").decode()
RECEIVER = Path(__file__).resolve().parent.parent / "tests" / "support" / "fixtures" / "receiver.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Hooks:
    """The receiver process and what it logged."""

    def __init__(self, root: Path) -> None:
        self.port = free_port()
        self.log = root / "webhooks.jsonl"
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.deliverer_kills = 0

    def section(self) -> dict[str, Any]:
        return {"url": f"http://127.0.0.1:{self.port}/hooks", "secret": SECRET, "timeout": 2,
                "retry_base": 0.2, "retry_horizon": 3600, "concurrency": 4}  # fmt: skip

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(RECEIVER.parent.parent))
        self.proc = subprocess.Popen(
            [sys.executable, str(RECEIVER), str(self.port), SECRET, str(self.log)],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1),
            ):
                return
            time.sleep(0.05)
        raise RuntimeError("the webhook receiver did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self, down_s: float) -> None:
        self.stop()
        time.sleep(down_s)  # deliveries meanwhile meet a refused connection
        self.start()
        self.restarts += 1

    def kill_deliverer(self, supervisor_pid: int, title: Callable[[int], str]) -> bool:
        for pid in children_of(supervisor_pid):
            if title(pid).startswith("derivd: webhooks"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    self.deliverer_kills += 1
                    return True
        return False

    def received(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        lines = self.log.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]


def wait_delivered(query: Callable[..., list[tuple[Any, ...]]], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = query("SELECT count(*) FROM derivd_deliveries WHERE status IN"
                     " ('pending', 'delivering')")  # fmt: skip
        if rows[0][0] == 0:
            return True
        time.sleep(0.5)
    return False


def checks(
    query: Callable[..., list[tuple[Any, ...]]], hooks: Hooks
) -> list[tuple[str, bool, str]]:
    files = {r[0]: (r[1], r[2]) for r in query(
        "SELECT id, status, error_code FROM archive_files"
        " WHERE status IN ('ready', 'rejected')")}  # fmt: skip
    received = hooks.received()
    unverified = [r["id"] for r in received if not r["verified"]]
    ids_of: dict[tuple[int, str], set[str]] = defaultdict(set)
    bodies: dict[str, set[str]] = defaultdict(set)
    phantom: list[str] = []
    for r in received:
        body = json.loads(r["body"])
        key = (int(body["data"]["file_id"]), body["type"])
        ids_of[key].add(r["id"])
        bodies[r["id"]].add(r["body"])
        row = files.get(key[0])
        want = {"file.ready": "ready", "file.rejected": "rejected"}.get(key[1])
        if want and (row is None or row[0] != want or body["data"]["error_code"] != row[1]):
            phantom.append(f"{r['id']}:{key}")
    wanted = {(i, "file.ready" if s == "ready" else "file.rejected") for i, (s, _) in files.items()}
    missing = sorted(k for k in wanted if k not in ids_of)
    split = [k for k, ids in ids_of.items() if len(ids) > 1]
    changed = [i for i, b in bodies.items() if len(b) > 1]
    duplicates = len(received) - len(bodies)
    return [
        ("webhooks: every ready/rejected file's event received", not missing,
         f"{len(wanted)} events, {len(received)} requests, {hooks.deliverer_kills} deliverer "
         f"kill(s), {hooks.restarts} receiver restart(s); missing {missing[:6]}"),
        ("webhooks: duplicates share their webhook-id and body", not split and not changed,
         f"{duplicates} duplicate(s); ids split {split[:4]}, bodies changed {changed[:4]}"),
        ("webhooks: no event for a commit that did not happen", not phantom,
         f"contrary to the rows: {phantom[:6]}"),
        ("webhooks: every signature verifies", not unverified, f"unverified: {unverified[:6]}"),
    ]  # fmt: skip
