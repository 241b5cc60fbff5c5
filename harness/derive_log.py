"""A handler that logs each derive start, for the chaos runs' history checker.

`[derive] backend = harness.derive_log:Vips` (or `:Pillow`) runs that backend unchanged
and, as each derive begins, appends one line to the file named by $HARNESS_DERIVE_LOG: the
job's id, its attempt's token and number, the worker's pid and the time. That is what
the tables cannot say: whether an attempt charged for a crash or a timeout had started
its derive, and how often a file was derived (harness.invariants).

The handler is given the original's bytes only; the job it derives for is the one its
caller holds (the nearest frame of the calling stack with a job among its locals,
directly or as an attribute `job`), whatever the worker loop's shape.

$HARNESS_SLOW_DERIVES names a JSON file, original key -> seconds: the first attempt's
derive of that original takes that much longer (jobs near [supervisor] job_timeout; a
retry is not slowed, so a job killed at its deadline ends all the same). The chaos run
writes it before it queues the originals.

Imported by the worker processes (PYTHONPATH holds the repository's root); never by derivd.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from harness.history import DeriveStart

LOG_ENV = "HARNESS_DERIVE_LOG"  # not DERIVD_: derivd refuses variables it does not know
SLOW_ENV = "HARNESS_SLOW_DERIVES"


def _job_like(value: object) -> bool:
    return (
        isinstance(getattr(value, "id", None), int)
        and isinstance(getattr(value, "token", None), uuid.UUID)
        and isinstance(getattr(value, "attempt", None), int)
    )


def _jobs_in(frame: FrameType) -> Iterator[Any]:
    for value in frame.f_locals.values():
        if _job_like(value):
            yield value
        nested = getattr(value, "job", None)
        if _job_like(nested):
            yield nested
        args = getattr(value, "args", None)  # a pool's work item: the call it runs
        if isinstance(args, tuple):
            yield from (a for a in args if _job_like(a))
            yield from (a.job for a in args if _job_like(getattr(a, "job", None)))


def calling_job() -> Any | None:
    """The job of the nearest calling frame that holds one, or None."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        for job in _jobs_in(frame):
            return job
        frame = frame.f_back
    return None


def record(path: str, job: Any | None) -> None:
    """One line per derive start, appended with one write (O_APPEND): a SIGKILL right
    after it keeps it, and workers' lines never interleave."""
    line = {
        "job": None if job is None else job.id,
        "token": None if job is None else str(job.token),
        "attempt": None if job is None else job.attempt,
        "pid": os.getpid(),
        "at": time.time(),
    }
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
    finally:
        os.close(fd)


def extra_seconds(key: str | None) -> float:
    path = os.environ.get(SLOW_ENV)
    if not path or key is None:
        return 0.0
    try:
        return float(json.loads(Path(path).read_text()).get(key, 0.0))
    except (OSError, ValueError):
        return 0.0


class _Logged:
    """The named built-in backend, its derive logged (and stretched, when asked)."""

    backend = ""

    def __init__(self, spec: Any) -> None:
        from derivd.handlers.registry import handler_factory

        self.inner = handler_factory(self.backend)(spec)
        self.name = self.inner.name
        self.log = os.environ.get(LOG_ENV)

    def derive(self, original: bytes, spec: Any) -> Any:
        job = calling_job()
        if self.log:
            record(self.log, job)
        if job is not None and job.attempt == 1:
            time.sleep(extra_seconds(getattr(job, "original_key", None)))
        return self.inner.derive(original, spec)


class Vips(_Logged):
    backend = "vips"


class Pillow(_Logged):
    backend = "pillow"


def backend_for(name: str) -> str:
    """`[derive] backend` for built-in backend `name`, logged."""
    logged = {"vips": Vips, "pillow": Pillow}[name]
    return f"{__name__}:{logged.__name__}"


def read(path: Path) -> list[DeriveStart]:
    """The log's derive starts, in the order they were written. A start whose job the
    handler could not find is kept with job -1: the checker reports it."""
    if not path.exists():
        return []
    out = []
    for text in path.read_text().splitlines():
        if not text.strip():
            continue
        line = json.loads(text)
        out.append(
            DeriveStart(
                job=-1 if line["job"] is None else int(line["job"]),
                token=str(line["token"]),
                attempt=int(line["attempt"] or 0),
                pid=int(line["pid"]),
                at=float(line["at"]),
            )
        )
    return out
