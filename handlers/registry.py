"""Find a handler by name: built-ins first, then the `derivd.handlers` entry points.

Built-ins are imported lazily so that nothing image-related (libvips above all) is
loaded before the supervisor forks.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from derivd.handlers.base import DeriveSpec, Handler

ENTRY_POINT_GROUP = "derivd.handlers"
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

BUILTIN: dict[str, str] = {
    "vips": "derivd.handlers.vips:VipsHandler",
    "pillow": "derivd.handlers.pillow:PillowHandler",
    "noop": "derivd.handlers.noop:NoopHandler",
}
# Each built-in image backend's check that it can write every configured format; the
# handler runs it when created, `derivd config check` before anything starts.
ENCODER_CHECKS: dict[str, str] = {
    "vips": "derivd.handlers.vips:check_encoders",
    "pillow": "derivd.handlers.pillow:check_encoders",
}


class UnknownHandler(LookupError):
    def __init__(self, name: str, detail: str | None = None) -> None:
        super().__init__(
            f"cannot load handler {name!r}: {detail}"
            if detail
            else f"unknown handler {name!r}; known: {', '.join(known_handlers())}"
        )
        self.name = name


def known_handlers() -> list[str]:
    plugins = [ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)]
    return sorted(set(BUILTIN) | set(plugins))


def _load_target(target: str) -> Callable[..., Any]:
    module_name, _, attr = target.partition(":")
    obj: Callable[..., Any] = getattr(importlib.import_module(module_name), attr)
    return obj


def is_import_target(name: str) -> bool:
    """`package.module:Class` names a handler directly, without an entry point (tests,
    in-tree experiments)."""
    module_name, sep, attr = name.partition(":")
    return bool(sep) and _DOTTED.match(module_name) is not None and attr.isidentifier()


def handler_factory(name: str) -> Callable[..., Any]:
    """The class (or factory) registered under `name`, without instantiating it."""
    if is_import_target(name):
        try:
            return _load_target(name)
        except (ImportError, AttributeError) as error:
            raise UnknownHandler(name, str(error)) from error
    if name in BUILTIN:
        return _load_target(BUILTIN[name])
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            factory: Callable[..., Any] = ep.load()
            return factory
    raise UnknownHandler(name)


def missing_encoder(name: str, spec: DeriveSpec) -> str | None:
    """Why backend `name` cannot write the formats `spec` asks for (one line), or None.
    Imports the backend: for `derivd config check`, never the supervisor before fork."""
    from derivd.handlers.base import MissingEncoder

    if name not in ENCODER_CHECKS:
        return None
    try:
        _load_target(ENCODER_CHECKS[name])(spec)
    except MissingEncoder as problem:
        return str(problem)
    return None


def create_handler(name: str, spec: DeriveSpec) -> Handler:
    """Instantiate the handler `name` for `spec`. Call only in a worker, after fork.

    A factory receives the `DeriveSpec` once, to set up per-process state (libvips
    concurrency and cache, Pillow limits); `derive` receives it again on every job.
    """
    handler: Handler = handler_factory(name)(spec)
    return handler
