"""Every setting, declared once: section, name, type, default, validation, one-line doc.

The INI parser, `derivd config check|show` and the example `etc/derivd.ini` all come from
these declarations. Any setting can also come from the environment as
`DERIVD_<SECTION>_<KEY>` (e.g. `DERIVD_DATABASE_DSN`), which is how secrets stay out of
the file; any other `DERIVD_*` name (but `DERIVD_CONFIG`) is refused like an unknown key,
so a misspelled override never goes unnoticed. Relative paths resolve against the config
file's directory, so a command means the same state from any working directory.
"""

from __future__ import annotations

import configparser
import dataclasses
import difflib
import os
import re
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from derivd.handlers.base import DeriveSpec, PreviewSpec, VariantSpec
from derivd.handlers.preview_spec import KINDS
from derivd.redact import MASK, mask_dsn, mask_url, parse_dsn, shown_url
from derivd.storage.base import prefix_problem
from derivd.variant_config import (
    SECTION_PREFIX,
    build_variants,
    check_formats,
    check_listed,
    check_size,
    is_variant_section,
)
from derivd.webhooks.endpoints import (
    EVENTS,
    Endpoint,
    build_endpoints,
    check_events,
    check_tenants,
    check_url,
    is_webhook_section,
)
from derivd.webhooks.endpoints import SECTION_PREFIX as WEBHOOK_PREFIX

DEFAULT_CONFIG = Path("etc/derivd.ini")
CONFIG_ENV = "DERIVD_CONFIG"  # the config file when -c is not given
ENV_PREFIX = "DERIVD_"
DEFAULTS = "(defaults)"  # the source of a config read from no file
Check = Callable[[Any], str | None]  # returns a problem, or None when the value is fine


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
class Bounds:
    """A number's range, finite at both ends: every numeric setting declares one, so a
    value like `inf` or `1e300` is refused at load instead of overflowing an interval, an
    integer column or a timer later. `above`: strictly more than `low`; `between`: the
    message names both ends (a scale, like quality 1-100)."""

    low: float
    high: float
    above: bool = False
    between: bool = False

    def __call__(self, value: float) -> str | None:
        low_ok = value > self.low if self.above else value >= self.low
        if low_ok and value <= self.high:  # NaN fails both comparisons
            return None
        low, high = _number(self.low), _number(self.high)
        if self.between:
            return f"must be between {low} and {high}"
        if not low_ok and value < self.high:
            return f"must be greater than {low}" if self.above else f"must be {low} or more"
        return f"must be at most {high}"


def _number(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:g}"


def positive(high: float) -> Bounds:
    return Bounds(0, high, above=True)


def non_negative(high: float) -> Bounds:
    return Bounds(0, high)


def in_range(low: int, high: int) -> Bounds:
    return Bounds(low, high, between=True)


fraction = Bounds(0, 1, between=True)


# Upper bounds, generous for any real deployment, small enough for every use downstream
# (PostgreSQL intervals and integers, timers, sizes in bytes).
MINUTE, HOUR, DAY = 60.0, 3600.0, 86400.0
DAYS_MAX = 36_500  # a century of days
COUNT_MAX = 1_000_000_000  # fits PostgreSQL's integer


# A schema name derivd puts in search_path and in DDL as it is: nothing to quote.
SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def schema_name_problem(value: str) -> str | None:
    """[database] schema: empty, or a name derivd uses as it is (nothing to quote)."""
    if not value or SCHEMA_NAME.match(value):
        return None
    return f"{value!r} is not a lower-case name (a letter or _, then letters, digits or _)"


def one_of(*choices: str) -> Check:
    def check(value: str) -> str | None:
        return None if value in choices else f"{value!r} is not one of: {', '.join(choices)}"

    return check


def split_host_port(value: str) -> tuple[str, int]:
    """`host:port` (IPv6 as `[::1]:9464`; an empty host means every interface) ->
    (host, port). ValueError when it is not of that form."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{value!r} is not host:port")
    return host.strip("[]") or "0.0.0.0", int(port)


def host_port(value: str) -> str | None:
    if not value:
        return None
    try:
        _host, port = split_host_port(value)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        return "must be host:port (e.g. 127.0.0.1:9464), or empty for off"
    return None


def check_handler(value: str) -> str | None:
    from derivd.handlers.registry import BUILTIN, is_import_target, known_handlers  # no backend

    # A built-in name needs no look at the installed packages' entry points (a scan of
    # every distribution's metadata, paid by every command that loads the config).
    if value in BUILTIN or is_import_target(value):  # `module:Class`: checked in the worker
        return None
    known = known_handlers()
    return None if value in known else f"unknown backend {value!r}; known: {', '.join(known)}"


def listed_kinds(text: str) -> frozenset[str]:
    return frozenset(k.strip() for k in text.split(",") if k.strip())


def check_kinds(value: str) -> str | None:
    unknown = sorted(listed_kinds(value) - set(KINDS))
    if unknown:
        return f"unknown kind {unknown[0]!r}; kinds: {', '.join(KINDS)}"
    return None


def parse_variants(text: str) -> tuple[VariantSpec, ...]:
    """`preview:1600, thumb:320` -> variants in order (shorthand only: no sections)."""
    problem = check_listed(text)
    specs, problems = build_variants(text, {})
    if problem or problems:
        raise ValueError(problem or problems[0][2])
    return specs


def check_dsn(value: str) -> str | None:
    # libpq's own complaint may quote a word of the password: it is not repeated here.
    if not value or parse_dsn(value) is not None:
        return None
    return (
        "not a libpq connection string or URL that libpq can read (a value with spaces "
        "needs single quotes: password='a b'; in a URL, percent-encode it)"
    )


HOST_ID_MAX_BYTES = 200
HEARTBEAT_AUTO_MAX = 10.0  # seconds: a dead host is called stale within 30 s by default


def check_host_id(value: str) -> str | None:
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        return "must not contain control characters"
    if len(value.encode()) > HOST_ID_MAX_BYTES:
        return f"must be at most {HOST_ID_MAX_BYTES} bytes"
    return None


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


@dataclass(frozen=True)
class Problem:
    """One bad setting. `section` and `key` are None where none applies (a file that
    cannot be read, an unknown section, an unknown environment variable)."""

    where: str
    section: str | None
    key: str | None
    message: str

    def __str__(self) -> str:
        scope = " ".join(filter(None, (self.section and f"[{self.section}]", self.key)))
        return (
            f"{self.where}: {scope}: {self.message}" if scope else f"{self.where}: {self.message}"
        )


class ConfigError(Exception):
    """One or more bad settings; str() gives one line per problem."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("\n".join(str(p) for p in problems))
        self.problems = problems


_TRUE = {"1", "yes", "true", "on"}
_FALSE = {"0", "no", "false", "off"}


def _convert(kind: type[Any], raw: str) -> Any:
    text = raw.strip()
    if kind is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError(f"{raw!r} is not yes/no")
    if kind is int:
        try:
            return int(text.replace("_", ""))
        except ValueError:
            raise ValueError(f"{raw!r} is not a whole number") from None
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{raw!r} is not a number") from None
    return text


def _env_name(section: str, key: str) -> str:
    return f"{ENV_PREFIX}{section.upper()}_{key.upper()}"


def known_env_names() -> tuple[str, ...]:
    """Every `DERIVD_*` name derivd reads (variant sections have no overrides)."""
    settings = (_env_name(name, f.name) for name, cls in SECTIONS.items() for f in fields(cls))
    return (CONFIG_ENV, *settings)


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name `name` was most likely meant to be, if any is close."""
    found = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return found[0] if found else None


def _did_you_mean(name: str, known: Iterable[str], shown: Callable[[str], str] = str) -> str:
    guess = closest(name, known)
    return f"did you mean {shown(guess)}? " if guess else ""


def _env_problems(env: Mapping[str, str]) -> list[Problem]:
    known = known_env_names()
    # Compared without the prefix every name shares, which would make anything look close.
    suffixes = [k.removeprefix(ENV_PREFIX) for k in known]
    return [
        Problem(
            f"environment {name}",
            None,
            None,
            "unknown variable; "
            + _did_you_mean(name.removeprefix(ENV_PREFIX), suffixes, ENV_PREFIX.__add__)
            + "settings come as DERIVD_<SECTION>_<KEY> (see `derivd config show`)",
        )
        for name in sorted(env)
        if name.startswith(ENV_PREFIX) and name not in known
    ]


def config_location(given: Path | None, env: Mapping[str, str]) -> tuple[Path, bool]:
    """(the config file to read, whether it must exist): `-c`, else $DERIVD_CONFIG, else
    etc/derivd.ini, which alone may be absent (built-in defaults)."""
    if given is not None:
        return given, True
    if env.get(CONFIG_ENV):
        return Path(env[CONFIG_ENV]), True
    return DEFAULT_CONFIG, False


def _read_ini(path: Path, problems: list[Problem]) -> dict[str, dict[str, str]]:
    # Comments as in the INI readers people know: on their own line, or after a value
    # following whitespace (`events = file.ready  # default: all four`). Without the
    # inline ones, `tenants =   # empty: every tenant` named the tenant "# empty: ...".
    # A `#` or `;` not after whitespace stays in the value (`https://host/#part`).
    parser = configparser.ConfigParser(
        interpolation=None, strict=True, inline_comment_prefixes=("#", ";")
    )
    try:
        with path.open(encoding="utf-8") as handle:
            parser.read_file(handle)
    except configparser.Error as error:
        line = getattr(error, "lineno", None)
        where = f"{path}:{line}" if line else str(path)
        problems.append(Problem(where, None, None, str(error).splitlines()[0]))
        return {}
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        problems.append(Problem(str(path), None, None, f"cannot read: {reason}"))
        return {}
    return {name: dict(parser.items(name)) for name in parser.sections()}


def _resolve_path(value: str, base: Path) -> str:
    """A path setting made absolute: relative values against `base`."""
    return os.path.normpath(base / value) if value and not Path(value).is_absolute() else value


def _section_values(
    name: str,
    raw: Mapping[str, str],
    env: Mapping[str, str],
    where: str,
    problems: list[Problem],
    *,
    base: Path,
    origins: dict[tuple[str, str], str],
    cls: type[Any] | None = None,
) -> Any:
    """One section from the file's `raw` values and the environment; a relative path
    from the file (or a default) resolves against `base`, from the environment against
    the working directory."""
    cls = cls or SECTIONS[name]
    hints = get_type_hints(cls)
    declared = {f.name: f for f in fields(cls)}
    for key in raw:
        if key not in declared:
            problems.append(
                Problem(
                    where,
                    name,
                    key,
                    f"unknown setting; {_did_you_mean(key, declared)}known: {', '.join(declared)}",
                )
            )
    values: dict[str, Any] = {}
    for key, spec in declared.items():
        env_key = _env_name(name, key)
        from_env = env_key in env
        source, text = (
            (f"environment {env_key}", env[env_key]) if from_env else (where, raw.get(key))
        )
        if from_env:
            origins[(name, key)] = source
        if text is None:
            if spec.metadata.get("path"):
                values[key] = _resolve_path(str(spec.default), base)
            continue
        try:
            value = _convert(hints[key], text)
        except ValueError as error:
            problems.append(Problem(source, name, key, str(error)))
            continue
        check: Check | None = spec.metadata.get("check")
        problem = check(value) if check else None
        if problem:
            problems.append(Problem(source, name, key, problem))
            continue
        if spec.metadata.get("path"):
            value = _resolve_path(value, Path.cwd() if from_env else base)
        values[key] = value
    return cls(**values)


def _cross_checks(config: Config) -> list[Problem]:
    queue = config.queue
    problems = _lease_checks(config)
    if problem := _orphan_guard_problem(config):
        problems.append(config.problem("sweep", "orphan_guard", problem))
    if queue.retry_max < queue.retry_base:
        problems.append(config.problem("queue", "retry_max", "must be at least retry_base"))
    if config.storage.backend == "s3" and not config.storage.bucket:
        problems.append(config.problem("storage", "bucket", "required when backend = s3"))
    return problems


def _orphan_guard_problem(config: Config) -> str | None:
    """An attempt's objects must outlive every PUT the attempt can still make: the sweep
    deletes an uncommitted object once it is older than the guard and its token holds no
    lease, and an attempt whose lease was lost (or never renewed) may still be PUTting
    until the supervisor's kill lands, job_timeout + kill_grace after its start. Without
    renewal that is below the lease (the lease check), with `renew = yes` it may be far
    above it (lease 30, job_timeout 600)."""
    queue, sup = config.queue, config.supervisor
    guard = config.sweep.orphan_guard
    if guard <= queue.lease:
        return f"must exceed [queue] lease ({queue.lease:g}s): live attempts keep their objects"
    longest = sup.job_timeout + sup.kill_grace
    if guard <= longest:
        return (
            f"must exceed [supervisor] job_timeout + kill_grace ({longest:g}s): an attempt "
            "may store objects until it is killed"
        )
    return None


def _lease_checks(config: Config) -> list[Problem]:
    sup, queue = config.supervisor, config.queue
    problems: list[Problem] = []
    # Without renewal the supervisor must be able to kill a job and record its failure
    # while the lease is still ours; otherwise a second worker could reclaim a job that
    # is still running. With renewal the heartbeat keeps the lease ahead of the job.
    if not queue.renew and sup.job_timeout + sup.kill_grace > 0.8 * queue.lease:
        problems.append(
            config.problem(
                "supervisor",
                "job_timeout",
                f"job_timeout + kill_grace ({sup.job_timeout + sup.kill_grace:g}s) must be at most "
                f"80% of [queue] lease ({0.8 * queue.lease:g}s), or set [queue] renew = yes",
            )
        )
    # Three heartbeats per lease: one late or lost heartbeat never loses a renewed lease,
    # and a host is called stale (3 missed heartbeats) no later than its leases expire.
    if queue.heartbeat_s > queue.lease / 3:
        problems.append(
            config.problem(
                "queue",
                "heartbeat",
                f"must be at most a third of [queue] lease ({queue.lease / 3:g}s)",
            )
        )
    return problems


def load_config(
    path: Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    required: bool = False,
) -> Config:
    """Read `path` (default: $DERIVD_CONFIG, else `etc/derivd.ini`) plus `DERIVD_*`
    overrides and validate all.

    A missing default file means built-in defaults; a missing explicit file is an error.
    Relative paths resolve against the file's directory (the working directory when no
    file is read). Raises ConfigError listing every problem with file, section and key.
    """
    env = os.environ if env is None else env
    if path is None:
        path, required = config_location(None, env)
    problems = _env_problems(env)
    raw: dict[str, dict[str, str]] = {}
    where, base = str(path), Path(os.path.abspath(path)).parent
    if path.exists():
        raw = _read_ini(path, problems)
    elif required:
        raise ConfigError([*problems, Problem(where, None, None, "no such file")])
    else:
        where, base = DEFAULTS, Path.cwd()
    for name in raw:
        if name not in SECTIONS and not is_variant_section(name) and not is_webhook_section(name):
            guess = _did_you_mean(name, KNOWN_SECTIONS, lambda s: f"[{s}]")
            problems.append(
                Problem(
                    where, name, None, f"unknown section; {guess}known: {', '.join(KNOWN_SECTIONS)}"
                )
            )
    origins: dict[tuple[str, str], str] = {}
    sections = {
        name: _section_values(
            name, raw.get(name, {}), env, where, problems, base=base, origins=origins
        )
        for name in SECTIONS
    }
    # No environment overrides for variant sections: their names hold a NAME of the file's.
    variant_sections = {
        name.removeprefix(SECTION_PREFIX): _section_values(
            name, values, {}, where, problems, base=base, origins={}, cls=VariantSettings
        )
        for name, values in raw.items()
        if is_variant_section(name)
    }
    webhook_sections = {
        name.removeprefix(WEBHOOK_PREFIX): _section_values(
            name, values, {}, where, problems, base=base, origins={}, cls=WebhookSettings
        )
        for name, values in raw.items()
        if is_webhook_section(name)
    }
    if problems:
        raise ConfigError(problems)
    webhooks, webhook_problems, unread = build_endpoints(webhook_sections, env)
    config = Config(
        **sections,
        variant_sections=variant_sections,
        webhook_sections=webhook_sections,
        webhooks=webhooks,
        source=where,
        origins=origins,
    )
    config = dataclasses.replace(
        config, unread_secrets=tuple(config.problem(*problem) for problem in unread)
    )
    problems = _cross_checks(config)
    problems += [config.problem(sec, key, msg) for sec, key, msg in webhook_problems]
    _, variant_problems = build_variants(config.derive.variants, variant_sections)
    problems += [config.problem(sec, key, msg) for sec, key, msg in variant_problems]
    if problems:
        raise ConfigError(problems)
    return config


def render_value(value: Any) -> str:
    """A setting's value as the INI file (and the environment) spell it."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def example_config() -> Config:
    """What the checkout's `etc/derivd.ini` holds: the defaults, with the state in the
    checkout's `var/` (the file sits in `etc/`, and relative paths resolve against it)."""
    return Config().replace("supervisor", state_dir="../var")


def render_ini(config: Config | None = None, *, mask_secrets: bool = False) -> str:
    """The documented INI text of `config` (defaults when None): every setting, its doc."""
    config = config or Config()
    lines = [
        "# derivd configuration. Every setting is shown with its value; durations are",
        "# seconds. Any setting may instead come from the environment as",
        "# DERIVD_<SECTION>_<KEY>, e.g. DERIVD_DATABASE_DSN (keep secrets there).",
        "# Relative paths resolve against this file's directory.",
    ]
    for name in SECTIONS:
        section = getattr(config, name)
        lines += ["", f"[{name}]"]
        for spec in fields(section):
            value = render_value(getattr(section, spec.name))
            mask = spec.metadata.get("mask")
            if mask_secrets and mask is not None:
                value = mask(value)
            lines.append(f"# {spec.metadata['doc']}")
            origin = config.origins.get((name, spec.name))
            if origin:  # the file may say otherwise: this is the value in effect
                lines.append(f"# (from the {origin}, not the file)")
            lines.append(f"{spec.name} = {value}".rstrip())
    lines += _render_variants(config)
    lines += _render_webhooks(config, mask_secrets=mask_secrets)
    return "\n".join(lines) + "\n"


def describe_source(config: Config) -> str:
    """The comment lines `config show` starts with: which file it read (absolute), or
    that none was, and how many values the environment gave."""
    if config.source == DEFAULTS:
        lines = [
            f"# no config file read: built-in defaults ({DEFAULT_CONFIG} is not in "
            f"{Path.cwd()}; -c FILE or ${CONFIG_ENV} names one)"
        ]
    else:
        lines = [f"# read from {Path(config.source).resolve()}"]
    names = sorted(origin.removeprefix("environment ") for origin in config.origins.values())
    if names:
        lines.append(f"# from the environment: {', '.join(names)}")
    return "\n".join(lines) + "\n"


def _render_variants(config: Config) -> list[str]:
    """The `[variant:NAME]` sections; with none, a commented example of every key."""
    lines: list[str] = []
    sections: Mapping[str, VariantSettings | None] = config.variant_sections or {"NAME": None}
    for name, values in sections.items():
        prefix = "" if values is not None else "# "
        lines += ["", f"{prefix}[{SECTION_PREFIX}{name}]"]
        for spec in fields(VariantSettings):
            value = render_value(getattr(values or VariantSettings(), spec.name))
            lines.append(f"# {spec.metadata['doc']}")
            lines.append(f"{prefix}{spec.name} = {value}".rstrip())
    return lines


def _render_webhooks(config: Config, *, mask_secrets: bool) -> list[str]:
    """The `[webhook:NAME]` sections (secrets masked); with none, a commented example."""
    lines: list[str] = []
    sections: Mapping[str, WebhookSettings | None] = config.webhook_sections or {"NAME": None}
    for name, values in sections.items():
        prefix = "" if values is not None else "# "
        lines += ["", f"{prefix}[{WEBHOOK_PREFIX}{name}]"]
        for spec in fields(WebhookSettings):
            value = render_value(getattr(values or WebhookSettings(), spec.name))
            mask = spec.metadata.get("mask")
            if mask_secrets and mask is not None:
                value = mask(value)
            lines.append(f"# {spec.metadata['doc']}")
            lines.append(f"{prefix}{spec.name} = {value}".rstrip())
    return lines
