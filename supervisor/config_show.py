"""Printing the configuration as INI: `derivd config show` (with where each value came from)
and the example `etc/derivd.ini`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from derivd.config import DEFAULTS, SECTIONS, Config, VariantSettings, WebhookSettings
from derivd.config_load import CONFIG_ENV, DEFAULT_CONFIG
from derivd.variant_config import SECTION_PREFIX
from derivd.webhooks.endpoints import SECTION_PREFIX as WEBHOOK_PREFIX


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
