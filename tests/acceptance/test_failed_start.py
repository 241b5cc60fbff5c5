"""A start that fails after the supervisor registered its host (the metrics port taken,
a worker that cannot boot) leaves no registry row: the next start under the same name
would otherwise wait for that row to go stale (three heartbeats)."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

from helpers import sql

RunCli = Callable[..., subprocess.CompletedProcess[str]]


def _env(dsn: str, fs_root: Path, tmp_path: Path, **more: str) -> dict[str, str]:
    return {
        "DERIVD_DATABASE_DSN": dsn,
        "DERIVD_STORAGE_BACKEND": "fs",
        "DERIVD_STORAGE_ROOT": str(fs_root),
        "DERIVD_DERIVE_BACKEND": "noop",
        "DERIVD_SUPERVISOR_WORKERS": "1",
        "DERIVD_SUPERVISOR_STATE_DIR": str(tmp_path / "state"),
        **more,
    }


def test_a_start_refused_for_its_metrics_port_leaves_no_host_row(
    dsn: str, fs_root: Path, tmp_path: Path, run_cli: RunCli
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = _env(dsn, fs_root, tmp_path, DERIVD_METRICS_LISTEN=f"127.0.0.1:{port}")
        refused = run_cli("run", "--burst", env=env)
    assert refused.returncode == 2 and "cannot listen on" in refused.stderr
    assert sql(dsn, "SELECT host FROM derivd_hosts") == []


def test_a_worker_that_cannot_boot_leaves_no_host_row(
    dsn: str, fs_root: Path, tmp_path: Path, run_cli: RunCli
) -> None:
    env = _env(dsn, fs_root, tmp_path, DERIVD_DERIVE_BACKEND="faulthandlers:NoSuchHandler")
    halted = run_cli("run", env=env)
    assert halted.returncode != 0 and "worker could not start" in halted.stderr
    assert sql(dsn, "SELECT host FROM derivd_hosts") == []
