"""Every setting, declared once: section, name, type, default, validation, one-line doc.

The INI reader (`derivd.config_load`), `derivd config check|show` (`derivd.config_show`) and
the example `etc/derivd.ini` all come from these declarations; the checks they name are in
`derivd.config_checks`. Any setting can also come from the environment as
`DERIVD_<SECTION>_<KEY>` (e.g. `DERIVD_DATABASE_DSN`), which is how secrets stay out of
the file; any other `DERIVD_*` name (but `DERIVD_CONFIG`) is refused like an unknown key,
so a misspelled override never goes unnoticed. Relative paths resolve against the config
file's directory, so a command means the same state from any working directory.

One job past 450 lines: every section's settings declared together, each setting once.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from derivd.config_checks import (
    COUNT_MAX,
    DAY,
    DAYS_MAX,
    HEARTBEAT_AUTO_MAX,
    HOUR,
    MINUTE,
    Check,
    ConfigError,
    Problem,
    check_dsn,
    check_handler,
    check_host_id,
    check_kinds,
    fraction,
    host_port,
    in_range,
    listed_kinds,
    non_negative,
    one_of,
    parse_variants,
    positive,
    schema_name_problem,
)
from derivd.handlers.base import DeriveSpec, PreviewSpec, VariantSpec
from derivd.redact import MASK, mask_dsn, mask_url, shown_url
from derivd.storage.base import prefix_problem
from derivd.variant_config import (
    SECTION_PREFIX,
    build_variants,
    check_formats,
    check_listed,
    check_size,
)
from derivd.webhooks.endpoints import EVENTS, Endpoint, check_events, check_tenants, check_url
from derivd.webhooks.endpoints import SECTION_PREFIX as WEBHOOK_PREFIX

DEFAULTS = "(defaults)"  # the source of a config read from no file


def setting(
    default: Any,
    doc: str,
    *,
    check: Check | None = None,
    mask: Callable[[str], str] | None = None,
    path: bool = False,
) -> Any:
    """One declared setting. `mask`: how `config show` hides the secret the value may
    hold. `path`: a relative value resolves against the directory of the config file
    that holds it (the working directory without a file)."""
    return field(default=default, metadata={"doc": doc, "check": check, "mask": mask, "path": path})


@dataclass(frozen=True)
class DatabaseSettings:
    dsn: str = setting(
        "",
        "libpq connection string or URL; empty: a private PostgreSQL cluster under state_dir",
        check=check_dsn,
        mask=mask_dsn,
    )
    listen_dsn: str = setting(
        "",
        "direct connection for LISTEN when dsn is a transaction pooler (PgBouncer); empty: dsn",
        check=check_dsn,
        mask=mask_dsn,
    )
    schema: str = setting(
        "",
        "where derivd's tables live: a schema of its own beside the app's (e.g. derivd), "
        "or the app's; empty: the connection's search_path (public)",
        check=schema_name_problem,
    )
    listen_retry: float = setting(
        1.0,
        "seconds between a supervisor's attempts to (re)open its LISTEN connection, each "
        "checked for a pooler (workers poll meanwhile)",
        check=positive(HOUR),
    )


@dataclass(frozen=True)
class StorageSettings:
    backend: str = setting(
        "fs", "where originals and derivatives live: fs or s3", check=one_of("fs", "s3")
    )
    root: str = setting("", "fs: the store's directory; empty: <state_dir>/objects", path=True)
    bucket: str = setting("", "s3: bucket name (versioning must be enabled)")
    endpoint_url: str = setting(
        "", "s3: endpoint for MinIO/Ceph/other S3 APIs; empty: AWS", mask=mask_url
    )
    region: str = setting("", "s3: region; empty: from the AWS environment/profile")
    prefix: str = setting(
        "",
        "s3: where in the bucket derivd writes its objects, e.g. derivd/ (part of their keys)",
        check=lambda value: prefix_problem(value) if value else None,
    )


@dataclass(frozen=True)
class SupervisorSettings:
    workers: int = setting(0, "worker processes; 0: one per CPU", check=non_negative(1024))
    job_timeout: float = setting(
        30.0,
        "seconds one job may run before its worker is killed "
        "(below the lease unless [queue] renew = yes)",
        check=positive(7 * DAY),
    )
    kill_grace: float = setting(
        3.0,
        "seconds between SIGTERM and SIGKILL for a worker past its deadline",
        check=positive(HOUR),
    )
    shutdown_grace: float = setting(
        30.0,
        "seconds running jobs get to finish on SIGTERM before they are released",
        check=non_negative(DAY),
    )
    pipeline: int = setting(
        2,
        "jobs a worker holds at once, each at its own stage: the next original is fetched "
        "and derived while the previous job's variants are stored and committed; 1: one job "
        "at a time (also what a worker does with [queue] claim_batch above 1)",
        check=in_range(1, 4),
    )
    max_jobs_per_worker: int = setting(
        1000,
        "recycle a worker after this many jobs (with jitter); 0: never",
        check=non_negative(COUNT_MAX),
    )
    max_worker_rss_mb: int = setting(
        1024,
        "recycle a worker whose RSS exceeds this after a job; 0: never",
        check=non_negative(1024 * 1024),
    )
    pidfile: str = setting("", "write the supervisor's pid here; empty: no pidfile", path=True)
    state_dir: str = setting(
        "var", "directory for the embedded database, the fs store and runtime files", path=True
    )
    host_id: str = setting(
        "",
        "this supervisor's name in the host registry and on its claims; empty: the OS host "
        "name (set one per supervisor to run several on one machine)",
        check=check_host_id,
    )


@dataclass(frozen=True)
class QueueSettings:
    lease: float = setting(
        45.0,
        "seconds a claim stays valid (database time); a dead host's jobs come back after it",
        check=positive(7 * DAY),
    )
    heartbeat: float = setting(
        0.0,
        "seconds between a supervisor's lease checks (one statement for all its jobs) and "
        "host registry updates, at most lease / 3; 0: the smaller of 10 and lease / 3",
        check=non_negative(DAY),
    )
    renew: bool = setting(
        False,
        "the heartbeat also extends each held lease to now + lease, so job_timeout may "
        "exceed the lease (yes/no)",
    )
    max_attempts: int = setting(
        3, "attempts per file, crashes and timeouts included", check=in_range(1, 100)
    )
    retry_base: float = setting(
        5.0, "first retry delay in seconds; doubles per attempt", check=non_negative(7 * DAY)
    )
    retry_max: float = setting(300.0, "longest retry delay in seconds", check=non_negative(7 * DAY))
    retry_jitter: bool = setting(True, "full jitter: wait a random 0..delay (yes/no)")
    poll_interval: float = setting(
        1.0, "seconds between polls when idle (a fallback when listen = yes)", check=positive(HOUR)
    )
    listen: bool = setting(True, "wake idle workers with LISTEN/NOTIFY (yes/no)")
    exhausted_interval: float = setting(
        5.0,
        "seconds between a supervisor's rejections of rows whose worker died on their last "
        "attempt (attempts_exhausted)",
        check=positive(DAY),
    )
    claim_batch: int = setting(
        1,
        "rows claimed per round trip; raise for very short jobs; each row keeps its own lease",
        check=in_range(1, 100),
    )
    max_in_flight_per_tenant: int = setting(
        0,
        "most jobs of one tenant processing at once, fleet-wide (claims skip a tenant at "
        "the cap); 0: no cap",
        check=non_negative(COUNT_MAX),
    )

    @property
    def heartbeat_s(self) -> float:
        """The heartbeat interval in effect (`heartbeat`, or its automatic value)."""
        return self.heartbeat or min(HEARTBEAT_AUTO_MAX, self.lease / 3)


@dataclass(frozen=True)
class DeriveSettings:
    backend: str = setting(
        "vips", "image backend: vips, pillow, noop or a plugin's name", check=check_handler
    )
    variants: str = setting(
        "preview:1600, thumb:320",
        "comma-separated; name:EDGE (long edge in px, fit inside, webp) or the NAME of a "
        "[variant:NAME] section; the first is the primary",
        check=check_listed,
    )
    quality: int = setting(80, "quality, 1-100 (a variant may set its own)", check=in_range(1, 100))
    effort: int = setting(4, "WebP effort (CPU spent on compression), 0-6", check=in_range(0, 6))
    max_input_mb: float = setting(
        50.0, "largest original accepted, in MiB", check=positive(64 * 1024)
    )
    max_pixels: int = setting(
        100_000_000, "largest width x height x frames decoded", check=positive(10**12)
    )
    max_frames: int = setting(
        100, "most frames (pages) an original may declare", check=positive(COUNT_MAX)
    )
    concurrency: int = setting(1, "libvips threads per worker", check=in_range(1, 64))
    accept: str = setting(
        "image, pdf, video",
        "kinds of original accepted (image, pdf, video); another is unsupported_content",
        check=check_kinds,
    )
    max_pages: int = setting(10_000, "most pages a PDF may declare", check=positive(COUNT_MAX))
    pdf_page: int = setting(
        1, "the PDF page previewed (a shorter document: its last)", check=positive(COUNT_MAX)
    )
    max_duration: float = setting(
        3 * HOUR,
        "longest video accepted, in seconds, as its container declares",
        check=positive(DAYS_MAX * DAY),
    )
    max_streams: int = setting(
        32,
        "most streams (video, audio, subtitles, data) a video may hold",
        check=positive(10_000),
    )
    frame_offset: float = setting(
        0.1,
        "where a video's preview frame is looked for, as a fraction of its duration (the "
        "keyframe at or before it; almost uniform frames are skipped)",
        check=fraction,
    )
    shrink_on_load: str = setting(
        "fast",
        "JPEG/WebP decoded at the largest reduction the variants allow (fast, as sharp), or "
        "leaving the resize a factor of 2 (safe: a little sharper on fine detail, slower)",
        check=one_of("fast", "safe"),
    )

    def spec(self, variants: tuple[VariantSpec, ...] | None = None) -> DeriveSpec:
        """The handlers' spec; `variants` from `Config.derive_spec` when there are
        `[variant:NAME]` sections, else the shorthand list alone."""
        return DeriveSpec(
            variants=parse_variants(self.variants) if variants is None else variants,
            quality=self.quality,
            effort=self.effort,
            max_input_bytes=int(self.max_input_mb * 1024 * 1024),
            max_pixels=self.max_pixels,
            max_frames=self.max_frames,
            concurrency=self.concurrency,
            shrink_on_load=self.shrink_on_load,
            previews=PreviewSpec(
                accept=listed_kinds(self.accept),
                max_pages=self.max_pages,
                max_duration_s=self.max_duration,
                max_streams=self.max_streams,
                frame_offset=self.frame_offset,
                pdf_page=self.pdf_page,
            ),
        )


@dataclass(frozen=True)
class VariantSettings:
    """`[variant:NAME]`: one named output (combinations are checked by derivd.variant_config)."""

    size: str = setting("", "EDGE (long edge) or WxH (a box), in px", check=check_size)
    fit: str = setting(
        "inside",
        "inside (whole image within the box) or cover (fill the box exactly, crop the rest)",
        check=one_of("inside", "cover"),
    )
    gravity: str = setting(
        "centre",
        "cover only: centre, or a smart crop: attention or entropy",
        check=one_of("centre", "attention", "entropy"),
    )
    format: str = setting(
        "webp", "one or more of webp, avif, jpeg, png, comma-separated; each is stored",
        check=check_formats,
    )  # fmt: skip
    quality: int = setting(0, "1-100; 0: [derive] quality", check=in_range(0, 100))
    lossless: bool = setting(False, "webp only: lossless (yes/no)")
    upscale: bool = setting(False, "grow originals smaller than the box (yes/no)")
    animated: bool = setting(
        False, "keep the animation of GIF/WebP originals (webp, avif), else the first frame"
    )


@dataclass(frozen=True)
class WebhookSettings:
    """`[webhook:NAME]`: one receiver of signed events (derivd.webhooks.endpoints checks
    the secret and builds the Endpoint)."""

    url: str = setting(
        "", "http:// or https:// URL the events are POSTed to", check=check_url, mask=shown_url
    )
    secret: str = setting(
        "",
        "Standard Webhooks secret, whsec_<base64>; or set secret_env or secret_file instead",
        mask=lambda value: MASK if value else value,
    )
    secret_env: str = setting("", "name of an environment variable that holds the secret")
    secret_file: str = setting("", "file that holds the secret", path=True)
    events: str = setting(
        ", ".join(EVENTS), "comma-separated: any of " + ", ".join(EVENTS), check=check_events
    )
    tenants: str = setting(
        "", "comma-separated tenants whose files are announced; empty: all", check=check_tenants
    )
    timeout: float = setting(
        10.0,
        "seconds one POST may take in all (connect, send, response)",
        check=positive(10 * MINUTE),
    )
    retry_horizon: float = setting(
        86400.0,
        "seconds after the event past which it is not retried: failed",
        check=positive(30 * DAY),
    )
    retry_base: float = setting(
        5.0, "first retry delay (doubles per attempt, full jitter, at most an hour)",
        check=positive(HOUR),
    )  # fmt: skip
    concurrency: int = setting(
        4, "POSTs in flight to this endpoint at once, per host", check=in_range(1, 64)
    )
    circuit_max: float = setting(
        60.0,
        "most seconds between probes while the endpoint's circuit is open (the pause "
        "starts at retry_base and doubles with each failed probe)",
        check=positive(DAY),
    )


@dataclass(frozen=True)
class SweepSettings:
    orphan_guard: float = setting(
        3600.0,
        "seconds before an uncommitted object is deleted (must exceed the lease and "
        "job_timeout + kill_grace)",
        check=positive(10 * 365 * DAY),
    )
    delete_guard: float = setting(
        300.0,
        "seconds a deleted file's objects are kept before removal",
        check=non_negative(365 * DAY),
    )
    interval: float = setting(
        60.0, "seconds between the supervisor's sweeps; 0: off", check=non_negative(DAY)
    )
    events_retention_days: int = setting(
        90,
        "days archive_events keeps (whole days are dropped); 0: keep forever",
        check=non_negative(DAYS_MAX),
    )
    partitions_interval: float = setting(
        3600.0,
        "seconds between a supervisor's rounds of archive_events partitions (a week of days "
        "ahead, days past retention dropped; also at start); a round that finds the table "
        "locked retries within a minute",
        check=positive(DAY),
    )
    purge_deleted_days: int = setting(
        0,
        "days after which `deleted` rows are removed from archive_files; 0: keep them",
        check=non_negative(DAYS_MAX),
    )


@dataclass(frozen=True)
class MetricsSettings:
    listen: str = setting("", "host:port for Prometheus metrics; empty: off", check=host_port)
    interval: float = setting(
        15.0,
        "seconds between the queue stats queries behind the queue gauges",
        check=positive(HOUR),
    )


@dataclass(frozen=True)
class StatusSettings:
    """Health thresholds of `derivd status` (its exit status) and the dashboard's alerts."""

    max_oldest_age: float = setting(
        900.0,
        "unhealthy when the oldest claimable row has waited longer (seconds); 0: off",
        check=non_negative(365 * DAY),
    )
    max_expired_leases: int = setting(
        10,
        "unhealthy when more processing rows have an expired lease; 0: off",
        check=non_negative(COUNT_MAX),
    )
    max_rejected_ratio: float = setting(
        0.2,
        "a larger share of the jobs finished in the window rejected (users' bad uploads, "
        "mostly) is reported beside the verdict, unhealthy only with fail_on_rejected; 0: off",
        check=fraction,
    )
    fail_on_rejected: bool = setting(
        False, "a rejected share above max_rejected_ratio makes the verdict unhealthy (yes/no)"
    )
    max_webhook_age: float = setting(
        900.0,
        "unhealthy when an endpoint's oldest undelivered event has waited longer (seconds); 0: off",
        check=non_negative(365 * DAY),
    )
    max_webhook_open: float = setting(
        300.0,
        "unhealthy when an endpoint's circuit has been open longer while events wait for it "
        "(seconds); 0: off",
        check=non_negative(365 * DAY),
    )
    min_finished: int = setting(
        20,
        "jobs finished in the window before the rejected share is judged",
        check=positive(COUNT_MAX),
    )
    window: float = setting(
        3600.0,
        "seconds of events behind the recent counts and rejected share",
        check=positive(365 * DAY),
    )
    max_age: float = setting(
        15.0,
        "seconds a reading of the counts and recent events, computed by any host or probe, "
        "is reused (the supervisors refresh it every [metrics] interval); 0: compute each time",
        check=non_negative(HOUR),
    )
    min_hosts: int = setting(
        1,
        "unhealthy when fewer supervisors are alive while work is claimable (due queued rows "
        "or expired leases); 0: off",
        check=non_negative(10_000),
    )


@dataclass(frozen=True)
class LoggingSettings:
    level: str = setting(
        "info", "debug, info, warning or error", check=one_of("debug", "info", "warning", "error")
    )
    format: str = setting(
        "text", "text or json (one object per line)", check=one_of("text", "json")
    )


@dataclass(frozen=True)
class Config:
    database: DatabaseSettings = field(default_factory=DatabaseSettings)
    storage: StorageSettings = field(default_factory=StorageSettings)
    supervisor: SupervisorSettings = field(default_factory=SupervisorSettings)
    queue: QueueSettings = field(default_factory=QueueSettings)
    derive: DeriveSettings = field(default_factory=DeriveSettings)
    sweep: SweepSettings = field(default_factory=SweepSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    status: StatusSettings = field(default_factory=StatusSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    # `[variant:NAME]` sections by NAME, in file order.
    variant_sections: Mapping[str, VariantSettings] = field(default_factory=dict)
    # `[webhook:NAME]` sections by NAME, in file order, and their endpoints (secrets read).
    webhook_sections: Mapping[str, WebhookSettings] = field(default_factory=dict)
    webhooks: tuple[Endpoint, ...] = ()
    # Secrets of `webhooks` that could not be read: a problem only where derivd signs.
    unread_secrets: tuple[Problem, ...] = ()
    source: str = DEFAULTS
    # Where each (section, key) came from when it is not `source`: "environment NAME".
    origins: Mapping[tuple[str, str], str] = field(default_factory=dict)

    @property
    def state_dir(self) -> Path:
        return Path(self.supervisor.state_dir).resolve()

    @property
    def fs_root(self) -> Path:
        return (
            Path(self.storage.root).resolve() if self.storage.root else self.state_dir / "objects"
        )

    @property
    def worker_count(self) -> int:
        return self.supervisor.workers or os.cpu_count() or 1

    def derive_spec(self) -> DeriveSpec:
        """`[derive]` with every listed variant, sections included (validated at load)."""
        specs, problems = build_variants(self.derive.variants, self.variant_sections)
        if problems:
            raise ValueError("; ".join(str(self.problem(*p)) for p in problems))
        spec = self.derive.spec(specs)
        # What one preview render may allocate comes from the worker's own bound.
        memory = self.supervisor.max_worker_rss_mb * 1024 * 1024
        return dataclasses.replace(
            spec, previews=dataclasses.replace(spec.previews, memory_bytes=memory)
        )

    @property
    def host_id(self) -> str:
        """This supervisor's name in the host registry and on its claims."""
        return self.supervisor.host_id or socket.gethostname()

    def where(self, section: str, key: str | None) -> str:
        """The file (or environment variable) a setting came from, for error messages."""
        return self.origins.get((section, key), self.source) if key else self.source

    def signing(self, endpoint: str | None = None) -> Config:
        """This configuration for a command that signs webhooks (`run`, `webhooks test`
        of `endpoint`): ConfigError unless every secret it signs with was read."""
        wanted = None if endpoint is None else WEBHOOK_PREFIX + endpoint
        unread = [p for p in self.unread_secrets if wanted in (None, p.section)]
        if unread:
            raise ConfigError(unread)
        return self

    def problem(self, section: str, key: str | None, message: str) -> Problem:
        """A problem with one setting, named where that setting came from."""
        return Problem(self.where(section, key), section, key, message)

    def replace(self, section: str, **values: Any) -> Config:
        """A copy with some settings of one section changed (tests, `demo`)."""
        current = getattr(self, section)
        return dataclasses.replace(self, **{section: dataclasses.replace(current, **values)})


# Config's fields that are no fixed `[section]`.
_NOT_SECTIONS = ("source", "variant_sections", "webhook_sections", "webhooks", "unread_secrets",
                 "origins")  # fmt: skip
SECTIONS: dict[str, type[Any]] = {
    f.name: f.default_factory  # type: ignore[misc]
    for f in fields(Config)
    if f.name not in _NOT_SECTIONS
}
# What `unknown section` lists: the fixed sections and the named sections' patterns.
KNOWN_SECTIONS = (*SECTIONS, f"{SECTION_PREFIX}NAME", f"{WEBHOOK_PREFIX}NAME")
