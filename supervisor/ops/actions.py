"""Operator actions behind `derivd delete` and `derivd retry`.

Each action is one fenced statement in `QueueDB`; here we only sort the ids the operator
gave into what happened to each, and name the operator in the events.
"""

from __future__ import annotations

import getpass
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

from derivd.queue.db import QueueDB


def cli_actor() -> str:
    """`cli:<user>@<host>`: who ran the command, for the append-only events."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers)
        user = f"uid{os.getuid()}"
    return f"cli:{user}@{socket.gethostname()}"


@dataclass
class Sorted:
    """The outcome per id: `done` (changed now), `left` (exists, left alone, with its
    status), `unknown` (no such row)."""

    done: list[int] = field(default_factory=list)
    left: dict[int, str] = field(default_factory=dict)
    unknown: list[int] = field(default_factory=list)


def _sort(queue: QueueDB, ids: Sequence[int], done: Sequence[int]) -> Sorted:
    rest = sorted(set(ids) - set(done))
    statuses = queue.statuses(rest) if rest else {}
    return Sorted(
        done=sorted(done),
        left={i: statuses[i] for i in rest if i in statuses},
        unknown=[i for i in rest if i not in statuses],
    )


def delete(queue: QueueDB, ids: Sequence[int], *, actor: str) -> Sorted:
    """Move live rows to `deleting` (revoking any lease); rows already deleting or
    deleted are left alone."""
    return _sort(queue, ids, queue.request_delete(sorted(set(ids)), actor=actor))


def retry_ids(queue: QueueDB, ids: Sequence[int], *, actor: str) -> Sorted:
    """Queue these rejected rows again with their attempts reset; others are left alone."""
    return _sort(queue, ids, queue.operator_retry(ids=sorted(set(ids)), code=None, actor=actor))


@dataclass(frozen=True)
class Retried:
    """What `derivd retry --rejected` queued again: rejected files, and the files whose
    rejected re-derivation (backfill) was queued again (the file itself stays ready)."""

    files: list[int]
    rederivations: list[int]


def retry_rejected(queue: QueueDB, *, code: str | None, actor: str) -> Retried:
    """Queue every rejected row again (only those of `code` when given): files, and
    re-derivations (one row per file at most, so none can collide with a live one)."""
    return Retried(
        files=queue.operator_retry(ids=None, code=code, actor=actor),
        rederivations=queue.rederive_retry(code=code, actor=actor),
    )
