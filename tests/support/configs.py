"""Build Config objects and INI files for tests (real settings, no fakes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fixtures.pgbouncer import DIRECT_FOR

from derivd.config import Config
from derivd.config_load import load_config


def defaults(**env: str) -> Config:
    """What derivd reads with no INI file: the defaults and DERIVD_* variables in `env`."""
    return load_config(None, env=env)


def make_config(
    dsn: str,
    *,
    fs_root: Path | None = None,
    s3: dict[str, str] | None = None,
    **sections: dict[str, Any],
) -> Config:
    """A Config on the test database and an fs root (or s3 settings), plus overrides
    given per section: make_config(dsn, fs_root=p, queue={"lease": 5})."""
    # Through the test pooler, LISTEN gets the direct connection, as a deployment would.
    config = Config().replace("database", dsn=dsn, listen_dsn=DIRECT_FOR.get(dsn, ""))
    if s3 is not None:
        config = config.replace("storage", backend="s3", **s3)
    elif fs_root is not None:
        config = config.replace("storage", backend="fs", root=str(fs_root))
    for name, values in sections.items():
        config = config.replace(name, **values)
    return config


def write_ini(path: Path, sections: dict[str, dict[str, Any]]) -> Path:
    lines: list[str] = []
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {value}" for key, value in values.items()]
        lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
