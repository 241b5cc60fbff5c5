"""What the queue hands out and takes back: jobs, stored variants, finished attempts,
host reports, statistics (plain frozen records; no SQL here)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from derivd.handlers.base import Analysis


@dataclass(frozen=True)
class Job:
    id: int
    token: uuid.UUID
    attempt: int
    original_key: str
    original_version: str | None
    wait_s: float
    # The file whose variants this job makes: its own row, or for a re-derivation
    # (backfill) the ready file it re-derives (None: `id`).
    file_id: int | None = None

    @property
    def for_file(self) -> int:
        """The file id under whose prefix this job's objects are stored."""
        return self.id if self.file_id is None else self.file_id

    @property
    def label(self) -> str:
        """How a log line's text names this job: `file 7`, or `rederive job 53 of file 7`
        (a job id is no file id: `derivd show 53` knows no such file)."""
        if self.for_file == self.id:
            return f"file {self.id}"
        return f"rederive job {self.id} of file {self.for_file}"

    def log_fields(self) -> dict[str, int]:
        """How a log line names this job: its file, and a re-derivation as a job of its
        file (`rederive_job=53 file_id=7`): a job id is no file id (`derivd show 53`
        knows no such file)."""
        if self.for_file == self.id:
            return {"file_id": self.id}
        return {"rederive_job": self.id, "file_id": self.for_file}


class Committed(frozenset[int]):
    """The ids a fenced commit made official (a set, as callers test membership), and
    `rejected`: the re-derivations it refused instead, their set not the configured one
    (derivd_commit_rederivation). Every other id sent lost its lease."""

    rejected: frozenset[int]

    def __new__(cls, committed: Iterable[int] = (), rejected: Iterable[int] = ()) -> Committed:
        self = super().__new__(cls, committed)
        self.rejected = frozenset(rejected)
        return self


@dataclass(frozen=True)
class StoredVariant:
    name: str
    key: str
    version: str
    sha256: str
    width: int
    height: int
    format: str = "webp"
    content_type: str = "image/webp"
    fingerprint: str | None = None  # of the spec that made it (derivd.fingerprint)
    bytes: int | None = None  # the stored object's size; None: not recorded (before 0019)


@dataclass(frozen=True)
class Finished:
    """A derived attempt for the fenced commit: its variants as stored (the first is the
    primary) and the analysis of the original (None: the handler analysed nothing)."""

    job: Job
    variants: Sequence[StoredVariant]
    original: Analysis | None = None


@dataclass(frozen=True)
class HostInfo:
    """What a supervisor tells the host registry about itself."""

    host: str
    pid: int
    version: str
    backend: str
    workers: int
    busy: int
    heartbeat_s: float
    # The start the registry recorded for this run (register_host): the fence of its
    # heartbeats and of its clean stop. None: unfenced (tests, benchmarks).
    started_at: datetime | None = None
    # The variant set its workers derive (derivd.fingerprint.target_digest): what
    # `derivd backfill` compares. None: not told.
    variant_set: str | None = None


@dataclass(frozen=True)
class QueueStats:
    counts: dict[str, int]
    oldest_claimable_age_s: float | None
    expired_leases: int
    estimated: tuple[str, ...] = ()  # statuses whose count is a planner estimate
    age_s: float = 0.0  # how long ago the (fleet-shared) reading was computed

    @property
    def rejected_ratio(self) -> float:
        finished = sum(self.counts.get(s, 0) for s in ("ready", "rejected"))
        return self.counts.get("rejected", 0) / finished if finished else 0.0


@dataclass(frozen=True)
class EventWindow:
    """The recent events: how many of each kind, and the rejections by error code."""

    events: dict[str, int]
    rejected_by_code: dict[str, int]
    age_s: float = 0.0  # how long ago the (fleet-shared) reading was computed
