"""`[webhook:NAME]` sections: from settings to `Endpoint`s, with their secrets resolved.

The keys are declared in `derivd.config` (WebhookSettings) like every other setting; this
module checks what needs more than a type (the URL, the event names, where the secret
comes from) and resolves the secret: inline, from an environment variable
(`secret_env`) or from a file (`secret_file`). A problem never quotes the secret.
Problems come back as (section, key, message), and `derivd.config` adds the file name.

A secret that cannot be read here (its variable unset, its file unreadable, not of the
whsec_ form) is a problem only for the commands that sign (`Config.signing`): the
endpoint is built without its key, and `enqueue`, `status`, `show`, `webhooks list`…
run without it.
"""

from __future__ import annotations

import base64
import binascii
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from derivd.redact import register_secret


class WebhookValues(Protocol):
    """What this module reads of a `[webhook:NAME]` section (`derivd.config.WebhookSettings`
    declares the keys; naming them here keeps this module below the config that uses it)."""

    @property
    def url(self) -> str: ...
    @property
    def secret(self) -> str: ...
    @property
    def secret_env(self) -> str: ...
    @property
    def secret_file(self) -> str: ...
    @property
    def events(self) -> str: ...
    @property
    def tenants(self) -> str: ...
    @property
    def timeout(self) -> float: ...
    @property
    def retry_horizon(self) -> float: ...
    @property
    def retry_base(self) -> float: ...
    @property
    def concurrency(self) -> int: ...
    @property
    def circuit_max(self) -> float: ...


SECTION_PREFIX = "webhook:"
EVENTS = ("file.ready", "file.rejected", "file.rederived", "file.deleted")
SECRET_PREFIX = "whsec_"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
_TENANT_MAX = 200

EndpointProblem = tuple[str, str, str]  # section, key, message


@dataclass(frozen=True)
class Endpoint:
    """One receiver. `key`: the secret's decoded bytes (never printed: repr=False); None
    when it could not be read (`unread_secret` says why)."""

    name: str
    url: str
    key: bytes | None = field(repr=False)
    events: tuple[str, ...] = EVENTS
    tenants: tuple[str, ...] = ()  # empty: every tenant (and files without one)
    timeout: float = 10.0
    retry_horizon: float = 86400.0
    retry_base: float = 5.0
    concurrency: int = 4
    circuit_max: float = 60.0  # the longest pause between probes of an open circuit

    def signing_key(self) -> bytes:
        """The key to sign with: only a command that signs asks, once Config.signing()
        has said every secret it needs was read."""
        if self.key is None:
            raise RuntimeError(f"[webhook:{self.name}]: its secret was not read")
        return self.key

    def subscription(self) -> dict[str, object]:
        """What the database needs to fill the outbox (derivd_webhook_endpoints)."""
        return {"name": self.name, "events": list(self.events),
                "tenants": list(self.tenants) or None}  # fmt: skip


def is_webhook_section(section: str) -> bool:
    return section.startswith(SECTION_PREFIX)


def check_url(value: str) -> str | None:
    if not value:
        return None  # required: build_endpoints says so with the section's other problems
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("http", "https"):
        return "must be an http:// or https:// URL"
    if not parts.hostname:
        return "must name a host (http://host[:port]/path)"
    try:
        parts.port  # noqa: B018  (raises on a bad port)
    except ValueError:
        return "has a bad port"
    if parts.username or parts.password:
        return "must not carry credentials (sign with the secret instead)"
    return None


def parse_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def check_events(value: str) -> str | None:
    names = parse_list(value)
    if not names:
        return f"name one or more of: {', '.join(EVENTS)}"
    unknown = [n for n in names if n not in EVENTS]
    if unknown:
        return f"unknown event {unknown[0]!r}; known: {', '.join(EVENTS)}"
    return None


def check_tenants(value: str) -> str | None:
    for tenant in parse_list(value):
        if len(tenant) > _TENANT_MAX or any(ord(c) < 32 or ord(c) == 127 for c in tenant):
            return f"each tenant must be 1-{_TENANT_MAX} characters without control characters"
    return None


def decode_secret(text: str) -> bytes | None:
    """`whsec_<base64>` -> the key bytes; None when it is not of that form (or empty)."""
    text = text.strip()
    if not text.startswith(SECRET_PREFIX):
        return None
    body = text.removeprefix(SECRET_PREFIX)
    try:
        key = base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
    except (binascii.Error, ValueError):
        return None
    return key or None


def _secret_text(
    section: str, settings: WebhookValues, env: Mapping[str, str]
) -> tuple[str | None, EndpointProblem | None]:
    """The secret's text from the one place the section names (_secret_sources), or a
    problem."""
    key = next(k for k in ("secret", "secret_env", "secret_file") if getattr(settings, k))
    if key == "secret":
        register_secret(settings.secret)
        return settings.secret, None
    if key == "secret_env":
        value = env.get(settings.secret_env)
        if not value:
            return None, (section, key, f"environment variable {settings.secret_env} is not set")
        register_secret(value)
        return value, None
    try:
        text = Path(settings.secret_file).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or "not UTF-8 text"
        return None, (section, key, f"cannot read {settings.secret_file}: {reason}")
    register_secret(text)
    return text, None


def _secret_sources(section: str, settings: WebhookValues) -> EndpointProblem | None:
    """The section names exactly one place for its secret (a problem for every command)."""
    given = [k for k in ("secret", "secret_env", "secret_file") if getattr(settings, k)]
    if len(given) == 1:
        return None
    message = "set exactly one of secret, secret_env, secret_file" if given else "required"
    return (section, given[1] if len(given) > 1 else "secret", message)


def _read_key(
    section: str, settings: WebhookValues, env: Mapping[str, str]
) -> tuple[bytes | None, EndpointProblem | None]:
    """The secret's key bytes, or why it cannot be read here."""
    text, problem = _secret_text(section, settings, env)
    if problem or text is None:
        return None, problem
    key = decode_secret(text)
    if key is None:
        where = next(k for k in ("secret", "secret_env", "secret_file") if getattr(settings, k))
        return None, (section, where, "must be whsec_ followed by base64 (Standard Webhooks)")
    return key, None


def build_endpoint(
    name: str, settings: WebhookValues, env: Mapping[str, str]
) -> tuple[Endpoint | None, list[EndpointProblem], EndpointProblem | None]:
    """The endpoint, its problems (every command's), and why its secret could not be
    read (only the commands that sign refuse that)."""
    section = SECTION_PREFIX + name
    problems: list[EndpointProblem] = []
    if not _NAME.match(name):
        problems.append((section, "", "NAME must be 1-32 of a-z 0-9 _ - (it is a metric label)"))
    if not settings.url:
        problems.append((section, "url", "required"))
    source = _secret_sources(section, settings)
    if source:
        problems.append(source)
    if problems:
        return None, problems, None
    key, unread = _read_key(section, settings, env)
    endpoint = Endpoint(
        name=name,
        url=settings.url,
        key=key,
        events=parse_list(settings.events),
        tenants=parse_list(settings.tenants),
        timeout=settings.timeout,
        retry_horizon=settings.retry_horizon,
        retry_base=settings.retry_base,
        concurrency=settings.concurrency,
        circuit_max=settings.circuit_max,
    )
    return endpoint, [], unread


def build_endpoints(
    sections: Mapping[str, WebhookValues], env: Mapping[str, str]
) -> tuple[tuple[Endpoint, ...], list[EndpointProblem], list[EndpointProblem]]:
    """Every `[webhook:NAME]` section as an Endpoint, in file order, the problems, and
    the secrets that could not be read (a problem only where derivd signs)."""
    endpoints: list[Endpoint] = []
    problems: list[EndpointProblem] = []
    unread: list[EndpointProblem] = []
    for name, settings in sections.items():
        endpoint, found, secret = build_endpoint(name, settings, env)
        problems += found
        unread += [secret] if secret else []
        if endpoint is not None:
            endpoints.append(endpoint)
    return tuple(endpoints), problems, unread
