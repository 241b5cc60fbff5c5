"""The commands that run derivd or set it up: `run`, `migrate`, `demo`, `config check|show`."""

from __future__ import annotations

import os
import sys

import click

from derivd.cli.common import State, die, friendly_errors, main, pass_state
from derivd.config_checks import ConfigError
from derivd.config_show import render_ini


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
    from derivd.config_show import describe_source
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
    from derivd.config_checks import check_dsn
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
