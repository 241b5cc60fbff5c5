"""The commands that show the queue: `status`, `show`, `files`, `similar`."""

from __future__ import annotations

import json
import sys

import click

from derivd.cli.common import State, die, friendly_errors, main, parse_when, pass_state
from derivd.states import ERROR_CODES, STATUSES


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

    window = {"since": parse_when(since), "until": parse_when(until)}
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
