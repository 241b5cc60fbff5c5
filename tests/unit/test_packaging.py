"""The wheel installs one import root, `derivd`, with its queries, migrations and py.typed."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE_FOLDERS = {"supervisor": "derivd", "handlers": "derivd/handlers", "sql": "derivd/sql"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # setuptools builds in the tree's build/ folder: two xdist workers building at once
    # collide there ("File exists: build/bdist..."), so one builds at a time.
    (ROOT / "build").mkdir(exist_ok=True)
    with (ROOT / "build" / ".wheel-test.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        built = _pip_wheel(out)
    assert built.returncode == 0, built.stderr
    (wheel_file,) = out.glob("derivd-*.whl")
    return wheel_file


def _pip_wheel(out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
    )


@pytest.fixture(scope="module")
def wheel_names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_wheel_installs_nothing_outside_derivd_and_its_dist_info(
    wheel_names: list[str],
) -> None:
    tops = {name.split("/")[0] for name in wheel_names}
    dist_info = {top for top in tops if top.endswith(".dist-info")}
    assert tops - dist_info == {"derivd"}
    assert len(dist_info) == 1


def test_wheel_carries_every_source_file_under_its_derivd_name(wheel_names: list[str]) -> None:
    expected = {
        f"{target}/{path.relative_to(ROOT / folder).as_posix()}"
        for folder, target in SOURCE_FOLDERS.items()
        for path in (ROOT / folder).rglob("*")
        if path.suffix in (".py", ".sql") and "__pycache__" not in path.parts
    }
    assert expected - set(wheel_names) == set()
    assert "derivd/py.typed" in wheel_names
    assert "derivd/sql/queries.sql" in wheel_names
    assert "derivd/sql/functions.sql" in wheel_names  # every `derivd migrate` runs it
    assert any(n.startswith("derivd/sql/migrations/0001_") for n in wheel_names)


def test_console_script_and_handler_entry_points_name_derivd(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
        text = archive.read(name).decode()
    assert "derivd = derivd.cli:main" in text
    section = text.split("[derivd.handlers]")[1].split("[")[0]
    handlers = dict(line.split(" = ") for line in section.strip().splitlines())
    assert set(handlers) >= {"vips", "pillow", "noop"}
    assert all(value.startswith("derivd.handlers.") for value in handlers.values())


def test_the_wheel_ships_the_licence_its_metadata_names(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        text = archive.read(metadata).decode()
        (licence,) = [n for n in names if n.endswith("/LICENSE") and ".dist-info/" in n]
        shipped = archive.read(licence).decode()
    assert "License: MIT" in text or "License-Expression: MIT" in text
    assert shipped == (ROOT / "LICENSE").read_text() and shipped.startswith("MIT License")
    summary = next(line for line in text.splitlines() if line.startswith("Summary: "))
    assert "WebP images" not in summary  # variants may be AVIF, JPEG or PNG too


def test_descriptions_name_every_output_format() -> None:
    import derivd
    from derivd import cli

    for text in (derivd.__doc__ or "", cli.main.help or ""):
        assert "derives image variants (WebP, AVIF, JPEG, PNG)" in " ".join(text.split())


def _make_dry_run(target: str) -> str:
    """The commands `make TARGET` would run on a fresh clone (-B: as if nothing was
    installed yet; -n: without running them)."""
    result = subprocess.run(
        ["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return result.stdout


def test_make_run_installs_only_what_running_needs() -> None:
    """`make run` installed the test toolchain (622 MB) and apt-installed Chromium,
    PgBouncer and faketime for a demo that needs none of them."""
    run = _make_dry_run("run")
    assert "sh etc/system-deps.sh run" in run and "system-deps.sh test" not in run
    assert "pip install -q -e '.' " in run and "[test]" not in run
    test = _make_dry_run("test")
    assert "sh etc/system-deps.sh test" in test
    assert "pip install -q -e '.[test]' " in test
