"""Logging set-up: one line per event, as text (`key=value`) or JSON objects.

Call sites pass structured fields with `extra={"fields": {...}}` (see `event`). Only
safe values go there: ids, codes, durations. Exception text of user content is logged at
DEBUG only, and credentials never reach a log record (DSNs are masked before logging).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_CONFIGURED = False


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = getattr(record, "fields", {}) or {}
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        extra = "".join(f" {k}={_text(v)}" for k, v in fields.items())
        line = f"{stamp} {record.levelname.lower():7} {record.name}: {record.getMessage()}{extra}"
        if record.exc_info and record.levelno <= logging.DEBUG:
            line += "\n" + self.formatException(record.exc_info)
        return line


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
        return json.dumps(data, default=str)


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    text = str(value)
    return json.dumps(text) if (" " in text or not text) else text


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """Configure the root logger once per process (again after fork is harmless)."""
    global _CONFIGURED
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer", "pyvips", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    _CONFIGURED = True


def event(logger: logging.Logger, message: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log one structured event line."""
    logger.log(level, message, extra={"fields": fields})
