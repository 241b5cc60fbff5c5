"""The commands that change the queue: `enqueue`, `backfill`, `sweep`, `delete`, `retry`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from derivd.cli.common import (
    State,
    die,
    friendly_errors,
    id_list,
    main,
    pass_state,
    priority_option,
)
from derivd.priorities import BACKFILL_PRIORITY, DEFAULT_PRIORITY, TENANT_MAX_CHARS
from derivd.states import ERROR_CODES


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
        click.echo(f"rejected (attempts exhausted): {id_list(exhausted)}")
    if partitions.busy:
        click.echo("event partitions: archive_events is locked by a long reader; try later")
    if report.skipped:
        click.echo("sweep: another sweep is running (this or another host); nothing done")
        return
    for key in report.orphans_deleted:
        click.echo(f"orphan removed: {key}")
    if report.deletions_completed:
        click.echo(f"deleted: {id_list(report.deletions_completed)}")
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
        click.echo(f"accepted (now deleting): {id_list(result.done)}")
    for status in ("deleting", "deleted"):
        already = [i for i, s in result.left.items() if s == status]
        if already:
            click.echo(f"already {status}: {id_list(already)}")
    if result.unknown:
        click.echo(f"unknown: {id_list(result.unknown)}")
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
                click.echo(f"queued again: {id_list(retried.files)}")
            if retried.rederivations:
                click.echo(f"re-derivations queued again: {id_list(retried.rederivations)}")
            if not (retried.files or retried.rederivations):
                click.echo("nothing to retry")
            return
        result = actions.retry_ids(queue, ids, actor=actor)
    if result.done:
        click.echo(f"queued again: {id_list(result.done)}")
    if result.left:
        left = ", ".join(f"{i} ({s})" for i, s in result.left.items())
        click.echo(f"not rejected, left alone: {left}")
    if result.unknown:
        click.echo(f"unknown: {id_list(result.unknown)}")
        sys.exit(1)
