"""What the supervisor loads. It forks its workers, and libvips (its threads and caches) must
never cross a fork (DESIGN "Fork safety"), so the supervisor imports no image library,
before or after it forked workers that did."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psycopg
from configs import write_ini
from imagegen import jpeg

from derivd import client
from derivd.storage.fs import FsStorage

IMAGE_LIBRARIES = {"pyvips", "PIL"}

# Runs `derivd ARGS` in this interpreter and prints, as the process exits, the top-level
# modules it loaded: only the supervisor exits through atexit (workers end in os._exit).
_LOADED_AT_EXIT = """
import atexit, json, sys
atexit.register(lambda: print("MODULES " + json.dumps(sorted({m.split(".")[0]
                                                            for m in sys.modules}))))
from derivd.cli import main
sys.argv = ["derivd", *sys.argv[1:]]
main()
"""


def _top_level_modules(stdout: str) -> set[str]:
    line = next(line for line in stdout.splitlines() if line.startswith("MODULES "))
    return set(json.loads(line.removeprefix("MODULES ")))


def test_the_supervisor_imports_no_image_library(dsn: str, tmp_path: Path) -> None:
    """A real `run --burst` with two vips workers, which load libvips and derive a JPEG."""
    store = FsStorage(tmp_path / "store")
    version = store.put("originals/photo", jpeg(), "image/jpeg")
    with psycopg.connect(dsn, autocommit=True) as conn:
        file_id = client.enqueue(conn, "originals/photo", version)
    ini = write_ini(tmp_path / "derivd.ini", {
        "database": {"dsn": dsn},
        "storage": {"backend": "fs", "root": tmp_path / "store"},
        "supervisor": {"workers": 2, "state_dir": tmp_path / "state"},
        "derive": {"backend": "vips"},
    })  # fmt: skip
    ran = subprocess.run(
        [sys.executable, "-c", _LOADED_AT_EXIT, "-c", str(ini), "run", "--burst"],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    loaded = _top_level_modules(ran.stdout)
    assert "psycopg" in loaded  # the check sees the supervisor's real imports
    assert not loaded & IMAGE_LIBRARIES
    with psycopg.connect(dsn) as conn:
        assert client.result(conn, file_id).status == "ready"  # a worker did load libvips
