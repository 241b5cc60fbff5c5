"""Each command needs only what it uses: an endpoint's secret only where derivd signs
(`run`'s delivering process, `webhooks test`) and where that is checked (`config
check`); `enqueue`, `show`, `status`, `webhooks list`… run without it, and no output
names its value."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from configs import write_ini
from PIL import Image

RunCli = Callable[..., subprocess.CompletedProcess[str]]
VARIABLE = "APP_WEBHOOK_SECRET"
UNSET = f"environment variable {VARIABLE} is not set"


def ini(tmp_path: Path, dsn: str) -> Path:
    return write_ini(tmp_path / "derivd.ini", {
        "database": {"dsn": dsn},
        "storage": {"backend": "fs", "root": tmp_path / "objects"},
        "webhook:app": {"url": "http://127.0.0.1:9/hooks", "secret_env": VARIABLE},
        "webhook:other": {"url": "http://127.0.0.1:9/other", "secret_file": tmp_path / "no"},
    })  # fmt: skip


def without_secret() -> dict[str, str]:
    assert VARIABLE not in os.environ
    return {}


def test_commands_that_do_not_sign_run_without_the_secret(
    dsn: str, tmp_path: Path, run_cli: RunCli
) -> None:
    path = str(ini(tmp_path, dsn))
    image = tmp_path / "a.png"
    Image.new("RGB", (8, 8)).save(image)
    queued = run_cli("-c", path, "enqueue", str(image), env=without_secret())
    assert queued.returncode == 0, queued.stderr
    shown = run_cli("-c", path, "show", "1", "--json", env=without_secret())
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["row"]["id"] == 1  # the first row of a fresh database
    for args in (
        ["status", "--json"],
        ["webhooks", "list", "--json"],
        ["files", "--json"],
        ["config", "show"],
    ):
        done = run_cli("-c", path, *args, env=without_secret())
        assert done.returncode in (0, 1), (args, done.stderr)  # 1: status may be unhealthy
        assert UNSET not in done.stdout + done.stderr, args
    status = json.loads(run_cli("-c", path, "status", "--json").stdout)
    assert status["counts"]["queued"] == 1


def test_the_commands_that_sign_refuse_in_one_line_naming_the_variable(
    dsn: str, tmp_path: Path, run_cli: RunCli
) -> None:
    path = str(ini(tmp_path, dsn))
    for args in (["run", "--burst"], ["config", "check"], ["webhooks", "test", "app"]):
        done = run_cli("-c", path, *args, env=without_secret())
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert f"{path}: [webhook:app] secret_env: {UNSET}" in done.stderr, args
        assert "Traceback" not in done.stderr
    # A test of one endpoint needs that endpoint's secret only.
    secret = "whsec_" + "c2VjcmV0IHNlY3JldCBzZWNyZXQgc2VjcmV0IQ=="
    done = run_cli("-c", path, "webhooks", "test", "app", env={VARIABLE: secret})
    assert done.returncode == 1, done.stderr  # refused by the receiver's port, not by us
    assert "app: connection refused" in done.stdout
    assert secret not in done.stdout + done.stderr
