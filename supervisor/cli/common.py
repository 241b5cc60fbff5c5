"""What every `derivd` command shares: the top group, its state (the config read once),
the one-line failures, and the small argument parsers."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from derivd import __version__
from derivd.config import Config
from derivd.config_checks import ConfigError
from derivd.config_load import CONFIG_ENV, DEFAULT_CONFIG, config_location, load_config
from derivd.priorities import PRIORITY_MAX, PRIORITY_MIN

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


def id_list(values: list[int] | dict[int, str]) -> str:
    return " ".join(str(i) for i in values)


def parse_when(text: str | None) -> Any:
    """An ISO date or time given on the command line (naive: UTC)."""
    if text is None:
        return None
    from datetime import UTC, datetime

    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        die(f"{text!r} is not a date or time (e.g. 2026-12-02 or 2026-12-02T14:00)", 2)
    return value if value.tzinfo else value.replace(tzinfo=UTC)
