"""The one masker (derivd.redact) on its own: no fragment of a secret in a masked DSN,
URL, AWS key or log line, whatever quoting or encoding the secret arrives in. Through
a real `derivd` (`config show`, the log, error lines): tests/acceptance/test_redact.py."""

from __future__ import annotations

import logging

import pytest

from derivd import logs, redact
from derivd.config_checks import ConfigError
from derivd.config_load import load_config

# Each DSN carries the secret words Zq1 and Yp2 (and nothing else contains them).
SECRET_DSNS = [
    "host=db password='Zq1 is Yp2' user=u",
    "host=db password = 'Zq1 Yp2' port=5432",
    r"host=db password='Zq1\'s Yp2' user=u",
    r"host=db password='Zq1 \\ Yp2'",
    r"host=db password=Zq1\ Yp2 user=u",
    "host=db password=Zq1'Yp2 user=u",
    "host=db sslpassword='Zq1 Yp2' user=u",
    "postgresql://u:Zq1%20Yp2@db:5432/x",
    "postgresql://u:Zq1%40Yp2@db/x?sslmode=require",
    "postgresql://u:Zq1@Yp2@db/x",
    "postgres://db/x?user=u&password=Zq1%20Yp2&sslmode=require",
    "postgresql://db/x?sslmode=require&password=Zq1&Yp2",
]


@pytest.mark.parametrize("dsn", SECRET_DSNS)
def test_mask_dsn_leaves_no_fragment(dsn: str) -> None:
    masked = redact.mask_dsn(dsn)
    assert "Zq1" not in masked and "Yp2" not in masked, masked
    assert "***" in masked


@pytest.mark.parametrize("dsn", SECRET_DSNS)
def test_redact_masks_the_shapes_in_any_text(dsn: str) -> None:
    """Without knowing the secret: the shape alone is enough, inside a longer line."""
    line = redact.redact(f"connecting with dsn={dsn} failed after 3 tries")
    assert "Zq1" not in line and "Yp2" not in line, line
    assert line.endswith("failed after 3 tries") or "sslmode" not in line


def test_mask_dsn_keeps_what_is_not_secret() -> None:
    assert redact.mask_dsn("host=db password='hunter2 is long' user=x") == (
        "host=db password=*** user=x"
    )
    assert redact.mask_dsn("postgresql://u:s3cret@db/x?sslmode=require") == (
        "postgresql://u:***@db/x?sslmode=require"
    )
    assert redact.mask_dsn("postgresql://db/x?password=a%20b&sslmode=require") == (
        "postgresql://db/x?password=***&sslmode=require"
    )
    assert redact.mask_dsn("host=db dbname=x") == "host=db dbname=x"
    assert redact.mask_dsn("") == ""


def test_a_dsn_libpq_cannot_read_is_hidden_whole() -> None:
    # Unquoted, libpq reads "is" as the next key: no one can say where the password ends.
    assert redact.mask_dsn("host=db password=hunter2 is long") == "***"


def test_aws_secrets_and_presigned_urls() -> None:
    line = redact.redact(
        "aws_secret_access_key=Zq1Yp2/abc AWS_SESSION_TOKEN=Zq1tok "
        "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        "&X-Amz-Credential=AKIAZQ1%2F20240101&X-Amz-Signature=Yp2abcdef&x=1"
    )
    for leaked in ("Zq1", "Yp2", "AKIAZQ1"):
        assert leaked not in line, line
    assert "X-Amz-Algorithm=AWS4-HMAC-SHA256" in line and "x=1" in line


def test_a_registered_secret_is_masked_in_every_spelling() -> None:
    secret = "Zq1 it's Yp2 w@s"
    redact.register_secret(secret)
    for spelling in (
        secret,
        "Zq1 it\\'s Yp2 w@s",  # libpq-escaped
        "Zq1%20it%27s%20Yp2%20w%40s",  # percent-encoded
        "Zq1+it%27s+Yp2+w%40s",  # form-encoded
    ):
        line = redact.redact(f"error near {spelling} here")
        assert "Zq1" not in line and "Yp2" not in line, line


def test_the_log_formatters_use_the_one_masker() -> None:
    record = logging.LogRecord(
        "derivd.test",
        logging.INFO,
        __file__,
        1,
        "database host=db password='Zq1 is Yp2' user=u",
        (),
        None,
    )
    record.fields = {"dsn": "postgresql://u:Zq1%20Yp2@db/x"}  # type: ignore[attr-defined]
    for formatter in (logs.TextFormatter(), logs.JsonFormatter()):
        line = formatter.format(record)
        assert "Zq1" not in line and "Yp2" not in line, line


def test_a_malformed_dsn_is_a_config_error_without_an_echo() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(env={"DERIVD_DATABASE_DSN": "host=db password=hunter2 is long"})
    text = str(caught.value)
    assert "[database] dsn" in text
    assert "hunter2" not in text and '"is"' not in text and "long" not in text
