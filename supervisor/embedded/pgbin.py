"""Where this machine's PostgreSQL server binaries are (initdb, pg_ctl, postgres).

The embedded cluster (pgcluster.py) needs them; `derivd status` and the CLI name
PostgresNotFound's hint when they are missing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Final

from derivd.embedded import EmbeddedError

# Search locations, module-level so tests can point them elsewhere.
PG_CONFIG: Final = "pg_config"
SERVER_GLOB_ROOT = Path("/usr/lib/postgresql")
INSTALL_HINT: Final = (
    "PostgreSQL server binaries not found (looked in pg_config, PATH, "
    "/usr/lib/postgresql/*/bin); install them: apt-get install postgresql"
)


class PostgresNotFound(EmbeddedError):
    """No PostgreSQL server binaries on this machine."""


def _has_server(bindir: Path) -> bool:
    return all(os.access(bindir / name, os.X_OK) for name in ("initdb", "pg_ctl", "postgres"))


def _version_key(path: Path) -> tuple[int, ...]:
    # /usr/lib/postgresql/<version>/bin: "15" or "9.6"; unparsable names sort first.
    parts = re.findall(r"\d+", path.parent.name)
    return tuple(int(p) for p in parts) if parts else (-1,)


def find_server_bindir() -> Path:
    """Return the directory holding initdb, pg_ctl and postgres.

    Looks at `pg_config --bindir`, then `initdb` on PATH (symlinks resolved, since
    /usr/local/bin often holds only a couple of them), then the highest
    /usr/lib/postgresql/*/bin.
    """
    pg_config = shutil.which(PG_CONFIG)
    if pg_config is not None:
        try:
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out = ""
        if out and _has_server(Path(out)):
            return Path(out)
    initdb = shutil.which("initdb")
    if initdb is not None:
        bindir = Path(initdb).resolve().parent
        if _has_server(bindir):
            return bindir
    candidates = sorted(
        (p for p in SERVER_GLOB_ROOT.glob("*/bin") if _has_server(p)), key=_version_key
    )
    if candidates:
        return candidates[-1]
    raise PostgresNotFound(INSTALL_HINT)
