"""The one masker (derivd.redact): no fragment of a secret in `config show`, the log or an
error line, whatever quoting or encoding the secret arrives in.

Once, `DERIVD_DATABASE_DSN="host=db password='hunter2 is long'" derivd
config show` printed `password=*** is long'`.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from derivd import redact

RunCli = Callable[..., subprocess.CompletedProcess[str]]


# --------------------------------------------------------------------------- the CLI

DEFECT_DSN = "host=db password='hunter2 is long'"


def test_config_show_prints_no_fragment_of_a_quoted_password(run_cli: RunCli) -> None:
    result = run_cli("config", "show", env={"DERIVD_DATABASE_DSN": DEFECT_DSN})
    assert result.returncode == 0, result.stderr
    assert "dsn = host=db password=***\n" in result.stdout
    everything = result.stdout + result.stderr
    assert "hunter2" not in everything and "is long" not in everything


def test_a_malformed_dsn_stops_any_command_in_one_line(run_cli: RunCli) -> None:
    for args in (("config", "show"), ("status",), ("migrate",)):
        result = run_cli(*args, env={"DERIVD_DATABASE_DSN": "host=db password=hunter2 is long"})
        assert result.returncode == 2, (args, result.stderr)
        assert "Traceback" not in result.stderr
        assert "[database] dsn" in result.stderr
        assert "hunter2" not in result.stderr + result.stdout
        assert '"is"' not in result.stderr


def test_the_log_shows_no_fragment_of_a_quoted_password(run_cli: RunCli) -> None:
    """At DEBUG the CLI logs the DSN it connects to; nothing answers on port 1."""
    dsn = "host=127.0.0.1 port=1 connect_timeout=2 password='hunter2 is long'"
    for fmt in ("text", "json"):
        result = run_cli(
            "--log-level",
            "debug",
            "status",
            env={"DERIVD_DATABASE_DSN": dsn, "DERIVD_LOGGING_FORMAT": fmt},
        )
        assert result.returncode == 3, result.stderr
        assert "password=***" in result.stderr  # the log line is there, masked
        everything = result.stdout + result.stderr
        assert "hunter2" not in everything and "is long" not in everything, everything


def test_config_show_masks_the_user_info_of_the_s3_endpoint(run_cli: RunCli) -> None:
    """`[storage] endpoint_url = http://key:secret@minio:9000` was printed as it is."""
    endpoint = "http://Kx7derivd:Wq9%2Fsecret@127.0.0.1:9000/"
    assert redact.mask_url(endpoint) == "http://***@127.0.0.1:9000/"
    assert redact.mask_url("https://minio.internal:9000") == "https://minio.internal:9000"
    result = run_cli(
        "config",
        "show",
        env={"DERIVD_STORAGE_ENDPOINT_URL": endpoint, "DERIVD_STORAGE_BUCKET": "b"},
    )
    assert result.returncode == 0, result.stderr
    assert "endpoint_url = http://***@127.0.0.1:9000/\n" in result.stdout
    everything = result.stdout + result.stderr
    for fragment in ("Kx7derivd", "Wq9", "secret@"):
        assert fragment not in everything
