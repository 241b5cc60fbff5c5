"""The `derivd webhooks` group: list, test, resume, replay."""

from __future__ import annotations

import sys

import click

from derivd.cli.common import State, die, friendly_errors, main, parse_when, pass_state


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

    window = {"since": parse_when(since), "until": parse_when(until)}
    with database(state.config) as dsn, QueueDB.open(dsn, role="derivd-cli") as q:
        n = q.replay_deliveries(endpoint=endpoint, ids=list(file_ids) or None,
                                failed_only=failed_only, **window)  # fmt: skip
    click.echo(f"replayed: {n} deliveries" if n else "nothing to replay")
