"""The `derivd` command line (click). Commands stay thin: they parse, then call modules."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from derivd import __version__
from derivd.config import (
    CONFIG_ENV,
    DEFAULT_CONFIG,
    Config,
    ConfigError,
    config_location,
    load_config,
    render_ini,
)
from derivd.priorities import (
    BACKFILL_PRIORITY,
    DEFAULT_PRIORITY,
    PRIORITY_MAX,
    PRIORITY_MIN,
    TENANT_MAX_CHARS,
)
from derivd.states import ERROR_CODES, STATUSES

F = TypeVar("F", bound=Callable[..., Any])


def die(message: str, code: int = 1) -> NoReturn:
    from derivd.redact import redact

    click.echo(f"derivd: {redact(message)}", err=True)
    sys.exit(code)


def friendly_errors(fn: F) -> F:
    """Turn the failures an operator can fix into one line and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from derivd.embedded import EmbeddedError
        from derivd.errors import Transient
        from derivd.queue.db import SchemaMismatch
        from derivd.storage.base import StorageConfigError

        try:
            return fn(*args, **kwargs)
        except ConfigError as error:
            die(f"bad configuration:\n{error}", 2)
        except SchemaMismatch as error:
            die(str(error), 3)  # as `derivd status` says it
        except (Transient, StorageConfigError, EmbeddedError) as error:
            die(str(error))

    return wrapper  # type: ignore[return-value]


class State:
    def __init__(self, config_path: Path, explicit: bool, log_level: str | None) -> None:
        self.config_path = config_path
        self.explicit = explicit
        self.log_level = log_level
        self._config: Config | None = None

    @property
    def config(self) -> Config:
        if self._config is None:
            self._config = load_config(self.config_path, required=self.explicit)
            from derivd.logs import setup_logging
            from derivd.redact import dsn_password, url_secrets

            setup_logging(
                self.log_level or self._config.logging.level,
                self._config.logging.format,
                secrets=[
                    dsn_password(self._config.database.dsn),
                    dsn_password(self._config.database.listen_dsn),
                    *url_secrets(self._config.storage.endpoint_url),
                ],
            )
        return self._config


pass_state = click.make_pass_decorator(State)


def priority_option(default: int, meaning: str) -> Callable[[F], F]:
    """`--priority`, its range from derivd.priorities (checked there, one line on a bad one)."""
    return click.option(
        "--priority",
        type=int,
        default=default,
        show_default=True,
        help=f"{PRIORITY_MIN}..{PRIORITY_MAX}, {meaning}.",
    )


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "-c",
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    default=None,
    help=f"INI file to read [default: ${CONFIG_ENV}, else {DEFAULT_CONFIG}, built-in defaults "
    "when that is absent]. Relative paths inside it resolve against its directory.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    help="Override [logging] level.",
)
@click.version_option(__version__, prog_name="derivd")
@click.pass_context
def main(ctx: click.Context, config_path: Path | None, log_level: str | None) -> None:
    """derivd derives image variants (WebP, AVIF, JPEG, PNG) from uploaded originals, in
    the background, safely.

    An upload API stores the original (versioned), marks its row `queued` and answers at
    once; derivd's workers claim rows under a lease, derive the variants with libvips or
    Pillow, store them and commit with a fenced UPDATE.

    \b
    Quick start (embedded database and file store under ./var):
      derivd demo                   samples into the embedded database, processed, summed up
      derivd enqueue photos/        queue your own images
      derivd run                    run the daemon (Ctrl-C stops it gracefully)
    """
    ctx.obj = State(*config_location(config_path, os.environ), log_level)


@main.command()
@click.option(
    "--burst", is_flag=True, help="Exit 0 once nothing is claimable and the webhooks due are sent."
)
@click.option(
    "--workers",
    type=click.IntRange(min=0),
    help="Override [supervisor] workers (0: one per CPU).",
)
@pass_state
@friendly_errors
def run(state: State, burst: bool, workers: int | None) -> None:
    """Run the daemon: a supervisor that forks [supervisor] workers and keeps them alive.

    \b
    SIGTERM / Ctrl-C   stop claiming; running jobs get [supervisor] shutdown_grace to
                       finish, then they are killed and their rows go back to `queued`
                       without burning an attempt. A second signal does that at once.
    SIGHUP             re-read the config file and replace the workers gracefully.
    """
    from derivd.osproc import boot_without_gc, exit_without_teardown

    boot_without_gc()
    from derivd.processes.daemon import run_daemon

    if workers is not None:
        # Through the environment, so that a SIGHUP reload keeps the override.
        os.environ["DERIVD_SUPERVISOR_WORKERS"] = str(workers)
    exit_without_teardown(run_daemon(state.config.signing(), burst=burst))


@main.command()
@pass_state
@friendly_errors
def migrate(state: State) -> None:
    """Create or upgrade the schema (idempotent; safe from two hosts at once)."""
    from derivd.embedded.runtime import database
    from derivd.queue.db import check_schema
    from derivd.queue.db import migrate as apply_migrations
    from derivd.storage.configured import store_name

    with database(state.config, auto_migrate=False, check=False) as dsn:
        applied = apply_migrations(dsn, store_name(state.config), state.config.database.schema)
        check_schema(dsn)  # a schema newer than this version is refused, not "up to date"
    click.echo(f"applied: {', '.join(applied)}" if applied else "schema is up to date")


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--quiet", "-q", is_flag=True, help="Print only the new ids.")
@priority_option(DEFAULT_PRIORITY, f"higher runs first (backfill runs at {BACKFILL_PRIORITY})")
@click.option(
    "--tenant",
    help=f"Whose files these are (at most {TENANT_MAX_CHARS} characters); none by default.",
)
@click.option("--external-id", help="Your own reference, carried to results and webhooks.")
@click.option(
    "--metadata",
    metavar="JSON",
    help="A small JSON object carried to results and webhooks, e.g. '{\"album\": 7}'.",
)
@pass_state
@friendly_errors
def enqueue(
    state: State,
    paths: tuple[Path, ...],
    quiet: bool,
    priority: int,
    tenant: str | None,
    external_id: str | None,
    metadata: str | None,
) -> None:
    """Upload originals (files, or directories walked recursively) and queue them.

    Does what an upload API does: stores each file under a generated key
    (originals/<random id>; the file name is never used as a key), records the version
    the store confirmed, and inserts the row as `queued` (in batches). Hidden files are
    skipped. Prints one line per file: the new row id and the path; then run
    `derivd run` (or let a running one pick them up) and watch `derivd status`.
    """
    from derivd.client import InvalidContext, app_context
    from derivd.embedded.runtime import database
    from derivd.ops.enqueue import expand_paths, upload_and_queue
    from derivd.priorities import priority_problem, tenant_problem
    from derivd.queue.db import QueueDB
    from derivd.storage.configured import open_storage

    problem = priority_problem(priority) or tenant_problem(tenant)
    if problem:
        die(problem, 2)
    files = list(expand_paths(paths))
    # The database (and its schema) first: nothing is uploaded for a row that cannot exist.
    with (
        database(state.config, create=False) as dsn,
        QueueDB.open(dsn, role="derivd-enqueue") as queue,
    ):
        try:
            context = app_context(queue, external_id, _json_arg("--metadata", metadata))
        except InvalidContext as error:
            die(str(error), 2)
        storage = open_storage(state.config)
        storage.check()
        with click.progressbar(
            length=len(files), label="uploading", file=sys.stderr, hidden=quiet or len(files) < 2
        ) as bar:
            ids = upload_and_queue(
                files,
                storage,
                queue,
                progress=lambda _: bar.update(1),
                priority=priority,
                tenant=tenant,
                context=context,
            )
    for file_id, path in zip(ids, files, strict=True):
        click.echo(str(file_id) if quiet else f"{file_id}\t{path}")


def _json_arg(option: str, text: str | None) -> Any:
    """An option's JSON value (None when not given); one line, exit 2, when it is not JSON."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as error:
        die(f"{option} is not JSON: {error}", 2)


@main.command()
@click.option(
    "--apply", "apply_", is_flag=True, help="Queue the re-derivations (default: dry run)."
)
@click.option(
    "--max-queued",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="With --apply: at most this many re-derivations claimable at a time.",
)
@priority_option(
    BACKFILL_PRIORITY,
    f"with --apply, the re-derivations' priority (below live uploads at {DEFAULT_PRIORITY})",
)
@click.option(
    "--force",
    is_flag=True,
    help="With --apply: queue even while live hosts derive another variant set.",
)
@pass_state
@friendly_errors
def backfill(state: State, apply_: bool, max_queued: int, priority: int, force: bool) -> None:
    """Re-derive ready files whose variants differ from the configured ones.

    \b
    Without --apply: print, per variant (name.format), how many ready files miss it,
    have it made with another spec (changed) or have it no longer configured (extra).
    With --apply: queue one re-derivation per such file, page by page, at --priority,
    keeping at most --max-queued claimable. Each file stays `ready`, its old variants
    readable, until its re-derivation commits the new set; the old objects go to the
    sweep after [sweep] delete_guard. Ctrl-C or a crash: run it again to resume. One
    --apply runs at a time (any host). While live hosts derive another variant set
    (the registry knows each one's), --apply refuses: their workers would reject every
    re-derivation; --force queues anyway (a warning), as when they restart soon.
    """
    from derivd.embedded.runtime import database
    from derivd.fingerprint import configured_set, target_digest
    from derivd.ops.backfill import Apply, BackfillRunning, fleet_problem, scan
    from derivd.priorities import priority_problem
    from derivd.queue.db import QueueDB

    config = state.config  # variant sections that do not validate stop here (exit 2)
    problem = priority_problem(priority)
    if problem:
        die(problem, 2)
    configured = configured_set(config.derive_spec(), config.derive.backend)
    with (
        database(config, create=False) as dsn,
        QueueDB.open(dsn, role="derivd-backfill") as queue,
    ):
        problem = fleet_problem(queue.live_variant_sets(), target_digest(configured))
        if problem and apply_ and not force:
            die(problem)
        if problem:
            click.echo(f"derivd: warning: {problem.removesuffix(', or pass --force')}", err=True)
        if not apply_:
            for line in scan(queue, configured).lines(configured):
                click.echo(line)
            return
        bar = _Bar()
        run = Apply(
            queue,
            configured,
            priority=priority,
            max_queued=max_queued,
            progress=bar.show,
        )
        try:
            plan = run.run()
        except BackfillRunning as error:
            die(str(error))
        except KeyboardInterrupt:
            die("interrupted; run `derivd backfill --apply` again to resume", 130)
        finally:
            bar.close()
    click.echo(
        f"backfill: {plan.scanned} ready file(s) scanned, {plan.queued} re-derivation(s) "
        f"queued at priority {priority}; `derivd status` shows them through"
    )


class _Bar:
    """backfill's progress bar over the run's file ids (made once their range is known)."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.at = 0

    def show(self, cursor: int, last: int) -> None:
        if self.bar is None:
            self.bar = click.progressbar(length=max(1, last), label="backfill", file=sys.stderr)
            self.bar.__enter__()
        self.bar.update(cursor - self.at, cursor)
        self.at = cursor

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("--watch", is_flag=True, help="Refresh until Ctrl-C (in place on a terminal).")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=2.0,
    show_default=True,
    help="Seconds between refreshes with --watch.",
)
@click.option("--count", type=click.IntRange(min=1), help="With --watch: stop after N refreshes.")
@click.option("--max-oldest-age", type=click.FloatRange(min=0), help="Override [status].")
@click.option("--max-expired-leases", type=click.IntRange(min=0), help="Override [status].")
@click.option("--max-rejected-ratio", type=click.FloatRange(0, 1), help="Override [status].")
@click.option("--min-hosts", type=click.IntRange(min=0), help="Override [status].")
@pass_state
@friendly_errors
def status(
    state: State,
    as_json: bool,
    watch: bool,
    interval: float,
    count: int | None,
    max_oldest_age: float | None,
    max_expired_leases: int | None,
    max_rejected_ratio: float | None,
    min_hosts: int | None,
) -> None:
    """Queue health: rows per status, oldest claimable age, expired leases, rejected share,
    live hosts.

    \b
    Exit status (a health check for cron, systemd or Kubernetes):
      0  healthy
      1  unhealthy: a [status] threshold is crossed (0 turns one off)
      2  bad configuration or usage
      3  cannot tell: database unreachable or without the derivd schema
    """
    from derivd.ops.status import run_status

    config = state.config
    limits = {
        "max_oldest_age": max_oldest_age,
        "max_expired_leases": max_expired_leases,
        "max_rejected_ratio": max_rejected_ratio,
        "min_hosts": min_hosts,
    }
    overrides = {k: v for k, v in limits.items() if v is not None}
    if overrides:
        config = config.replace("status", **overrides)
    sys.exit(run_status(config, as_json_out=as_json, watch=watch, interval=interval, count=count))


@main.command()
@click.argument("file_id", type=click.IntRange(min=1), metavar="ID")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@pass_state
@friendly_errors
def show(state: State, file_id: int, as_json: bool) -> None:
    """One file: its row, the analysis of its original, every variant, its events.

    \b
    Examples:
      derivd show 42            what happened to file 42
      derivd show --json 42     the same, as one JSON object

    \b
    JSON (--json): {"row": {...}, "analysis": {...} or null, "variants": [...],
    "events": [...]}, times in ISO 8601 UTC. Exit 1 when no file has this id.
    Reads only.
    """
    from derivd.embedded.runtime import database
    from derivd.ops import show as view
    from derivd.queue.db import QueueDB

    with (
        database(state.config, read_only=True) as dsn,
        QueueDB.open(dsn, role="derivd-show") as queue,
    ):
        found = view.read(queue, file_id)
    if found is None:
        die(f"no file with id {file_id}")
    click.echo(view.to_json(found) if as_json else view.render(found))


@main.group()
def config() -> None:
    """Check or show the configuration."""


@config.command("check")
@pass_state
def config_check(state: State) -> None:
    """Validate the INI file; print each problem with its file, section and key."""
    try:
        cfg = state.config.signing()  # what `run` needs, its webhook secrets included
    except ConfigError as error:
        click.echo(str(error), err=True)
        sys.exit(2)
    from derivd.handlers.registry import missing_encoder

    problem = missing_encoder(cfg.derive.backend, cfg.derive_spec())
    if problem:
        click.echo(f"{cfg.source}: [derive] {problem}", err=True)
        sys.exit(2)
    click.echo(f"{cfg.source}: ok")


@config.command("show")
@click.option("--defaults", is_flag=True, help="Show the built-in defaults (an example file).")
@pass_state
@friendly_errors
def config_show(state: State, defaults: bool) -> None:
    """Print which file was read and which settings came from the environment, the
    effective configuration as INI with its documentation (secrets masked), then which
    database it names: for the embedded one, the DSN to reach it with."""
    if defaults:
        click.echo(render_ini(None, mask_secrets=True), nl=False)
        return
    from derivd.config import describe_source
    from derivd.embedded.runtime import describe_database

    config = state.config
    click.echo(
        describe_source(config)
        + render_ini(config, mask_secrets=True)
        + "\n"
        + describe_database(config),
        nl=False,
    )


@main.command()
@click.option(
    "--count",
    type=click.IntRange(min=1),
    default=24,
    show_default=True,
    help="How many good sample images to generate.",
)
@click.option("--backend", type=str, help="Override [derive] backend for the demo.")
@click.option(
    "--into",
    metavar="DSN",
    help="Queue the samples into this database, and the configured store, instead of the "
    "embedded ones.",
)
@pass_state
@friendly_errors
def demo(state: State, count: int, backend: str | None, into: str | None) -> None:
    """The embedded quick start: generate samples, queue them, process until drained.

    Runs on a private PostgreSQL cluster and a file store under [supervisor] state_dir,
    whatever [database] and [storage] say: the samples (two deliberately bad) reach
    another database only when `--into DSN` names it. Prints ready/rejected counts,
    throughput, where the derived files are, and a gallery page to open.
    """
    from derivd.config import check_dsn
    from derivd.demo import demo_config, run_demo

    if into is not None and (problem := check_dsn(into) if into else "give a DSN"):
        die(f"--into: {problem}", 2)
    config = demo_config(state.config, into=into)
    if into is None and state.config.database.dsn:
        click.echo(
            "demo: on the embedded database under "
            f"{config.state_dir}; [database] dsn is left alone (--into DSN to use it)",
            err=True,
        )
    if backend:
        config = config.replace("derive", backend=backend)
    sys.exit(run_demo(config, count=count))


def _ids(values: list[int] | dict[int, str]) -> str:
    return " ".join(str(i) for i in values)


@main.command()
@click.option(
    "--orphan-guard",
    type=click.FloatRange(min=0),
    metavar="SECONDS",
    help="Override [sweep] orphan_guard for this pass. Below [queue] lease it may remove "
    "objects an overdue attempt is still writing.",
)
@click.option(
    "--delete-guard",
    type=click.FloatRange(min=0),
    metavar="SECONDS",
    help="Override [sweep] delete_guard for this pass (0: finish every deletion now).",
)
@pass_state
@friendly_errors
def sweep(state: State, orphan_guard: float | None, delete_guard: float | None) -> None:
    """Run one round of the fleet's cleanup duties now and print what they did.

    \b
    In order:
      1. rejects files whose worker died on their last attempt (attempts_exhausted);
      2. event partitions: a week of days ahead, events of days no partition covered
         moved out of the DEFAULT partition, days past [sweep] events_retention_days
         dropped;
      3. a sweep pass: removes orphans (objects of attempts that never committed: a
         crash after PUT, a lost lease) once older than [sweep] orphan_guard, and
         finishes `derivd delete` after [sweep] delete_guard (every version of the
         original and every derived object, then the file is marked deleted).

    A running supervisor does each on its own timer. Running it by hand is safe at any
    time: one sweeper works at a time (any host), the others skip.
    """
    from derivd.embedded.runtime import database
    from derivd.ops.sweep import open_sweeper
    from derivd.processes.duties import EventPartitions, ExhaustedRejection

    config = state.config
    with (
        database(config) as dsn,
        open_sweeper(config, dsn, orphan_guard=orphan_guard, delete_guard=delete_guard) as sweeper,
    ):
        exhausted = ExhaustedRejection(lambda: config).run_once(sweeper.queue)
        partitions = EventPartitions(lambda: config).run_once(sweeper.queue)
        report = sweeper.run_once()
    if exhausted:
        click.echo(f"rejected (attempts exhausted): {_ids(exhausted)}")
    if partitions.busy:
        click.echo("event partitions: archive_events is locked by a long reader; try later")
    if report.skipped:
        click.echo("sweep: another sweep is running (this or another host); nothing done")
        return
    for key in report.orphans_deleted:
        click.echo(f"orphan removed: {key}")
    if report.deletions_completed:
        click.echo(f"deleted: {_ids(report.deletions_completed)}")
    click.echo(
        f"sweep: {len(exhausted)} exhausted, {len(report.orphans_deleted)} orphan(s), "
        f"{len(report.deletions_completed)} deletion(s), "
        f"{report.objects_deleted} object version(s) removed"
    )
    if report.error:
        die(f"sweep stopped early: {report.error} (run it again later)")


@main.command(short_help="Delete files by id: revoke their lease, remove their objects.")
@click.argument("ids", nargs=-1, required=True, type=click.IntRange(min=1), metavar="ID...")
@pass_state
@friendly_errors
def delete(state: State, ids: tuple[int, ...]) -> None:
    """Delete files by id (e.g. `derivd delete 41 42`).

    Each live file moves to `deleting` at once; a worker processing it loses its lease,
    so its commit can no longer succeed. After [sweep] delete_guard the sweep removes
    every version of the original and every derived object, then marks it `deleted`.
    Prints which ids were accepted and which were already gone or unknown; exits 1
    when an id is unknown. You (user@host) are recorded in the file's events.
    """
    from derivd.embedded.runtime import database
    from derivd.ops import actions
    from derivd.queue.db import QueueDB

    with (
        database(state.config, create=False) as dsn,
        QueueDB.open(dsn, role="derivd-cli") as queue,
    ):
        result = actions.delete(queue, ids, actor=actions.cli_actor())
    if result.done:
        click.echo(f"accepted (now deleting): {_ids(result.done)}")
    for status in ("deleting", "deleted"):
        already = [i for i, s in result.left.items() if s == status]
        if already:
            click.echo(f"already {status}: {_ids(already)}")
    if result.unknown:
        click.echo(f"unknown: {_ids(result.unknown)}")
        sys.exit(1)


@main.command()
@click.argument("ids", nargs=-1, type=click.IntRange(min=1), metavar="[ID...]")
@click.option(
    "--rejected", "all_rejected", is_flag=True, help="Retry every rejected file (see --code)."
)
@click.option(
    "--code",
    type=click.Choice(ERROR_CODES),
    help="With --rejected: only the files rejected with this error code.",
)
@pass_state
@friendly_errors
def retry(state: State, ids: tuple[int, ...], all_rejected: bool, code: str | None) -> None:
    """Queue rejected files again, with their attempts reset.

    \b
    Examples:
      derivd retry 41 42                                  these two files
      derivd retry --rejected --code attempts_exhausted   files whose worker kept
                                                          dying, once the cause is fixed
      derivd retry --rejected                             every rejected file

    Only `rejected` files change; the others are listed and left alone (exit 1 when
    an id is unknown). --rejected also queues again the rejected re-derivations of
    ready files (backfill), listed by file. Content errors (corrupt_content, unsupported_content,
    resource_limit) come back unless the limits or the backend changed. You
    (user@host) are recorded in each file's events.
    """
    if bool(ids) == all_rejected:
        die("give file ids, or --rejected for every rejected file (not both)", 2)
    if code and not all_rejected:
        die("--code selects among all rejected files: use it with --rejected", 2)
    from derivd.embedded.runtime import database
    from derivd.ops import actions
    from derivd.queue.db import QueueDB

    actor = actions.cli_actor()
    with (
        database(state.config, create=False) as dsn,
        QueueDB.open(dsn, role="derivd-cli") as queue,
    ):
        if all_rejected:
            retried = actions.retry_rejected(queue, code=code, actor=actor)
            if retried.files:
                click.echo(f"queued again: {_ids(retried.files)}")
            if retried.rederivations:
                click.echo(f"re-derivations queued again: {_ids(retried.rederivations)}")
            if not (retried.files or retried.rederivations):
                click.echo("nothing to retry")
            return
        result = actions.retry_ids(queue, ids, actor=actor)
    if result.done:
        click.echo(f"queued again: {_ids(result.done)}")
    if result.left:
        left = ", ".join(f"{i} ({s})" for i, s in result.left.items())
        click.echo(f"not rejected, left alone: {left}")
    if result.unknown:
        click.echo(f"unknown: {_ids(result.unknown)}")
        sys.exit(1)


def _when(text: str | None) -> Any:
    """An ISO date or time given on the command line (naive: UTC)."""
    if text is None:
        return None
    from datetime import UTC, datetime

    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        die(f"{text!r} is not a date or time (e.g. 2026-12-02 or 2026-12-02T14:00)", 2)
    return value if value.tzinfo else value.replace(tzinfo=UTC)


@main.command()
@click.option("--status", type=click.Choice(STATUSES), help="Only files in this status.")
@click.option("--code", type=click.Choice(ERROR_CODES), help="Only files rejected with this code.")
@click.option("--tenant", help="Only this tenant's files.")
@click.option("--since", help="Created at or after (ISO date or time, UTC unless given).")
@click.option("--until", help="Created before (ISO date or time).")
@click.option("--before", type=click.IntRange(min=1), help="Ids below this (the next page).")
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object: files and next_before.")
@pass_state
@friendly_errors
def files(
    state: State,
    status: str | None,
    code: str | None,
    tenant: str | None,
    since: str | None,
    until: str | None,
    before: int | None,
    limit: int,
    as_json: bool,
) -> None:
    """List files, newest first: by status, error code, tenant and time, a page at a time.

    \b
    Examples:
      derivd files --status rejected --code corrupt_content
      derivd files --tenant acme --since 2026-12-01 --json
      derivd files --before 1200          the page after one that ended at id 1201
    """
    from derivd.embedded.runtime import database
    from derivd.ops.files_view import files_json, files_table
    from derivd.queue.db import QueueDB

    window = {"since": _when(since), "until": _when(until)}
    with database(state.config, read_only=True) as dsn, QueueDB.open(dsn, role="derivd-cli") as q:
        rows = q.files_page(status=status, code=code, tenant=tenant, before=before, limit=limit,
                            **window)  # fmt: skip
    click.echo(files_json(rows, limit) if as_json else files_table(rows, limit))


@main.command()
@click.argument("file_id", type=click.IntRange(min=1), metavar="ID")
@click.option("--max-distance", type=click.IntRange(0, 64), default=6, show_default=True,
              help="Most differing bits of the 64-bit dhash.")  # fmt: skip
@click.option("--limit", type=click.IntRange(1, 10000), default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@pass_state
@friendly_errors
def similar(state: State, file_id: int, max_distance: int, limit: int, as_json: bool) -> None:
    """The ready files that look like file ID (near-duplicates by dhash), nearest first:
    one line each, its id and its distance in bits (--json: `similar`, the ids, and
    `distances`, theirs in the same order)."""

    from derivd.embedded.runtime import database
    from derivd.queue.db import QueueDB

    with database(state.config, read_only=True) as dsn, QueueDB.open(dsn, role="derivd-cli") as q:
        if q.status_of(file_id) is None:
            die(f"no file with id {file_id}")
        found = q.similar_distances(file_id, max_distance, limit)
    if as_json:
        ids, distances = [i for i, _ in found], [d for _, d in found]
        answer = {"id": file_id, "max_distance": max_distance, "similar": ids}
        click.echo(json.dumps({**answer, "distances": distances}))
    elif found:
        click.echo("\n".join(f"{i}\t{d} bit{'s' if d != 1 else ''}" for i, d in found))
    else:
        click.echo("no similar ready file")


@main.group()
def webhooks() -> None:
    """The [webhook:NAME] endpoints: their state, a test event, replays, resume."""


@webhooks.command("list")
@click.option("--json", "as_json", is_flag=True)
@pass_state
@friendly_errors
def webhooks_list(state: State, as_json: bool) -> None:
    """Each endpoint: where it posts, what it subscribes, its backlog, the oldest
    undelivered event, delivered and failed in the last [status] window, its circuit
    and last error (secrets never shown)."""
    import json

    from derivd.embedded.runtime import database
    from derivd.ops.durations import duration
    from derivd.ops.webhook_view import configured_json, endpoint_json, endpoint_lines
    from derivd.queue.db import QueueDB

    config = state.config
    with database(config, read_only=True) as dsn, QueueDB.open(dsn, role="derivd-cli") as q:
        rows = q.webhook_stats(window_s=config.status.window)
    if as_json:
        click.echo(json.dumps({"configured": configured_json(config.webhooks),
                               "endpoints": [endpoint_json(r) for r in rows]}))  # fmt: skip
        return
    for endpoint in configured_json(config.webhooks):
        click.echo(f"[webhook:{endpoint['name']}] {endpoint['url']}  events: "
                   f"{', '.join(endpoint['events'])}  tenants: "
                   f"{', '.join(endpoint['tenants']) or 'all'}")  # fmt: skip
    if not config.webhooks:
        click.echo("no [webhook:NAME] section in " + config.source)
    click.echo("\n".join(endpoint_lines(rows, duration(config.status.window))).lstrip("\n"))


@webhooks.command("test")
@click.argument("name")
@pass_state
@friendly_errors
def webhooks_test(state: State, name: str) -> None:
    """POST one signed test event (file_id 0) to endpoint NAME now, from here, and say
    what it answered: exit 0 on 2xx (which closes its circuit: its backlog flows), 1
    otherwise. Nothing enters the outbox."""
    from derivd.ops.webhook_view import send_test

    endpoint = next((e for e in state.config.webhooks if e.name == name), None)
    if endpoint is None:
        known = ", ".join(e.name for e in state.config.webhooks) or "none"
        die(f"no [webhook:{name}] section in {state.config.source} (known: {known})", 2)
    state.config.signing(name)
    ok, line = send_test(endpoint)
    click.echo(line)
    if ok:  # the first success closes the circuit, a test's included
        _close_after_test(state, name)
    sys.exit(0 if ok else 1)


def _close_after_test(state: State, name: str) -> None:
    """The test's answer stands whether or not this host reaches the database: without
    it, the circuit closes at the next probe that succeeds."""
    from derivd.embedded import EmbeddedError
    from derivd.errors import Transient
    from derivd.queue.db import SchemaMismatch

    try:
        _close_circuit(state, name, quiet=True)
    except (Transient, EmbeddedError, SchemaMismatch) as error:
        click.echo(f"{name}: its circuit was not closed from here ({error}); the next "
                   "probe that succeeds closes it")  # fmt: skip


@webhooks.command("resume")
@click.argument("name")
@pass_state
@friendly_errors
def webhooks_resume(state: State, name: str) -> None:
    """Close endpoint NAME's circuit by hand: its backlog is due now, and the delivering
    processes take it at once (after a receiver's fix that no probe has seen yet)."""
    _close_circuit(state, name, quiet=False)


def _close_circuit(state: State, name: str, *, quiet: bool) -> None:
    from derivd.embedded.runtime import database
    from derivd.queue.db import QueueDB

    with database(state.config) as dsn, QueueDB.open(dsn, role="derivd-cli") as q:
        found, was_open = q.close_circuit(name)
    if not found and not quiet:
        die(f"the database knows no endpoint {name!r} (`derivd webhooks list`)", 2)
    if was_open:
        click.echo(f"{name}: circuit closed; its backlog is due now")
    elif not quiet:
        click.echo(f"{name}: circuit already closed")


@webhooks.command("replay")
@click.option("--file", "file_ids", multiple=True, type=click.IntRange(min=1), metavar="ID",
              help="The events of this file (repeatable).")  # fmt: skip
@click.option("--since", help="Events made at or after (ISO date or time, UTC unless given).")
@click.option("--until", help="Events made before.")
@click.option("--failed", "failed_only", is_flag=True, help="Only failed deliveries.")
@click.option("--endpoint", help="Only this endpoint's deliveries.")
@pass_state
@friendly_errors
def webhooks_replay(
    state: State,
    file_ids: tuple[int, ...],
    since: str | None,
    until: str | None,
    failed_only: bool,
    endpoint: str | None,
) -> None:
    """Deliver finished events again (same webhook-id: receivers that had one drop it).

    \b
    Examples:
      derivd webhooks replay --failed                     every failed delivery
      derivd webhooks replay --file 41 --file 42          these files' events
      derivd webhooks replay --since 2026-12-02T10:00 --until 2026-12-02T11:00
    """
    if not (file_ids or since or until or failed_only):
        die("say what to replay: --file ID, --since/--until, or --failed", 2)
    from derivd.embedded.runtime import database
    from derivd.queue.db import QueueDB

    window = {"since": _when(since), "until": _when(until)}
    with database(state.config) as dsn, QueueDB.open(dsn, role="derivd-cli") as q:
        n = q.replay_deliveries(endpoint=endpoint, ids=list(file_ids) or None,
                                failed_only=failed_only, **window)  # fmt: skip
    click.echo(f"replayed: {n} deliveries" if n else "nothing to replay")


if __name__ == "__main__":  # python -m derivd.cli (the console script calls main itself)
    main()
