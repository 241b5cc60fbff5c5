"""Reading the configuration: the INI file, then `DERIVD_<SECTION>_<KEY>` from the environment,
checked setting by setting and across settings (`load_config`)."""

from __future__ import annotations

import configparser
import dataclasses
import difflib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, get_type_hints

from derivd.config import (
    DEFAULTS,
    KNOWN_SECTIONS,
    SECTIONS,
    Config,
    VariantSettings,
    WebhookSettings,
)
from derivd.config_checks import Check, ConfigError, Problem
from derivd.variant_config import SECTION_PREFIX, build_variants, is_variant_section
from derivd.webhooks.endpoints import SECTION_PREFIX as WEBHOOK_PREFIX
from derivd.webhooks.endpoints import build_endpoints, is_webhook_section

DEFAULT_CONFIG = Path("etc/derivd.ini")
CONFIG_ENV = "DERIVD_CONFIG"  # the config file when -c is not given
ENV_PREFIX = "DERIVD_"


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
