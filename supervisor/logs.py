"""Logging set-up: one line per event, as text (`key=value`) or JSON objects.

On the floor every room may use (the worker, the processes, the webhooks, the operators'
views): it imports nothing of derivd but `derivd.redact`.

Call sites pass structured fields with `extra={"fields": {...}}` (see `event`). Only
safe values go there: ids, codes, durations. Exception text of user content is logged at
DEBUG only, and credentials never reach a log record (DSNs are masked before logging).

As a second line of defence every formatted line goes through `derivd.redact` (the one
masker, which `config show` and the error messages use too): the values of known secrets
(the AWS secret key and session token, PGPASSWORD, the DSN's password), `password=` in
conninfo strings and URLs, and the signature and credential parameters of presigned S3
URLs become `***`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any

from derivd.redact import SECRET_ENV, redact, register_secret


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = getattr(record, "fields", {}) or {}
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        extra = "".join(f" {k}={_text(v)}" for k, v in fields.items())
        line = f"{stamp} {record.levelname.lower():7} {record.name}: {record.getMessage()}{extra}"
        if record.exc_info and record.levelno <= logging.DEBUG:
            line += "\n" + self.formatException(record.exc_info)
        return redact(line)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
        }
        data.update(getattr(record, "fields", {}) or {})
        if record.exc_info and record.levelno <= logging.DEBUG:
            data["exc"] = self.formatException(record.exc_info)
        # Redact the values, not the JSON text: escaping could hide a secret from a match.
        return json.dumps({k: _redact_value(v) for k, v in data.items()})


def _redact_value(value: Any) -> Any:
    if isinstance(value, bool | int | float) or value is None:
        return value
    if isinstance(value, list | tuple):
        return [_redact_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _redact_value(v) for k, v in value.items()}
    return redact(str(value))


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    text = str(value)
    return json.dumps(text) if (" " in text or not text) else text


def setup_logging(
    level: str = "info",
    fmt: str = "text",
    *,
    secrets: Iterable[str | None] = (),
    env: Mapping[str, str] | None = None,
) -> None:
    """Configure the root logger once per process (again after fork is harmless).

    `secrets` (e.g. the DSN's password) and the credentials in the environment are
    redacted from every line from now on."""
    env = os.environ if env is None else env
    for value in (*secrets, *(env.get(name) for name in SECRET_ENV)):
        register_secret(value)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # libvips reports every decode problem of user content as a warning; the job's outcome
    # line already says `corrupt_content`, and the detail is user-controlled text.
    logging.getLogger("pyvips").setLevel(logging.ERROR)


def event(logger: logging.Logger, message: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log one structured event line."""
    logger.log(level, message, extra={"fields": fields})
