"""The real `derivd` command as a subprocess: errors are one line, work gets done."""

from __future__ import annotations

import io
import subprocess
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from subprocess import CompletedProcess

import psycopg
import pytest
from configs import write_ini
from fixtures.cli import derivd_command
from fixtures.readonly import read_only_dir
from PIL import Image

from derivd.config import Config
from derivd.demo import Progress, demo_config
from derivd.embedded.pgcluster import discard
from derivd.queue.db import QueueDB

RunCli = Callable[..., CompletedProcess[str]]


def one_line_error(result: CompletedProcess[str]) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("derivd: ")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def fs_env(dsn: str, root: Path, **extra: str) -> dict[str, str]:
    return {
        "DERIVD_DATABASE_DSN": dsn,
        "DERIVD_STORAGE_BACKEND": "fs",
        "DERIVD_STORAGE_ROOT": str(root),
        **extra,
    }


def test_help_teaches_the_commands(run_cli: RunCli) -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    for command in ("run", "migrate", "enqueue", "config", "demo"):
        assert f"  {command}" in result.stdout
    assert "derivd demo" in result.stdout  # the quick start is in the help


def test_config_check_names_file_section_and_key(run_cli: RunCli, tmp_path: Path) -> None:
    path = write_ini(tmp_path / "bad.ini", {"queue": {"lease": "ten"}})
    result = run_cli("-c", str(path), "config", "check")
    assert result.returncode == 2
    assert f"{path}: [queue] lease: 'ten' is not a number" in result.stderr
    good = write_ini(tmp_path / "good.ini", {"queue": {"lease": "90"}})
    ok = run_cli("-c", str(good), "config", "check")
    assert ok.returncode == 0 and ok.stdout.strip() == f"{good}: ok"


def test_bad_config_stops_any_command_with_exit_2(run_cli: RunCli, tmp_path: Path) -> None:
    path = write_ini(tmp_path / "bad.ini", {"derive": {"backend": "gimp"}})
    result = run_cli("-c", str(path), "run", "--burst")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "[derive] backend: unknown backend 'gimp'" in result.stderr


def test_config_show_masks_the_password(run_cli: RunCli) -> None:
    result = run_cli("config", "show", env={"DERIVD_DATABASE_DSN": "host=x password=hunter2"})
    assert result.returncode == 0
    assert "dsn = host=x password=***" in result.stdout and "hunter2" not in result.stdout


def test_a_misspelled_environment_variable_stops_status(run_cli: RunCli, tmp_path: Path) -> None:
    """`DERIVD_DATABSE_DSN` was ignored and `status` reported `health: ok` on a fresh
    private cluster; now it is bad configuration (exit 2), naming the closest name."""
    result = run_cli("status", env={"DERIVD_DATABSE_DSN": "host=db"}, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert (
        "environment DERIVD_DATABSE_DSN: unknown variable; did you mean DERIVD_DATABASE_DSN?"
        in result.stderr
    )
    assert list(tmp_path.iterdir()) == []


def test_status_never_creates_a_cluster(run_cli: RunCli, tmp_path: Path) -> None:
    """From a directory where nothing ran, `status` says so (exit 3, "cannot tell")
    instead of starting an empty cluster there and calling it healthy."""
    result = run_cli("status", cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    line = one_line_error(result)
    assert f"no embedded database under {tmp_path / 'var'}" in line
    assert list(tmp_path.iterdir()) == []  # no var/, no cluster, no store


def test_enqueue_never_creates_a_cluster(run_cli: RunCli, tmp_path: Path) -> None:
    """From another directory, without -c, `enqueue` started a new embedded cluster in
    ./var and queued there, where no daemon would ever look; now it refuses as `status`
    does, in one line that says what to do, and nothing is made or uploaded."""
    image = tmp_path / "photos" / "a.png"
    image.parent.mkdir()
    Image.new("RGB", (8, 8)).save(image)
    for args in (("enqueue", str(image)), ("retry", "1"), ("delete", "1"), ("backfill",)):
        result = run_cli(*args, cwd=tmp_path)
        line = one_line_error(result)
        assert f"no embedded database under {tmp_path / 'var'}" in line, args
        assert "`derivd run` or `derivd demo` makes one" in line
        assert "-c" in line
        assert sorted(p.name for p in tmp_path.iterdir()) == ["photos"], args


def test_a_read_only_store_stops_enqueue_and_run_in_one_line(
    run_cli: RunCli, dsn: str, tmp_path: Path
) -> None:
    """`derivd enqueue` into a read-only store printed a 40-line traceback."""
    image = tmp_path / "a.png"
    Image.new("RGB", (8, 8)).save(image)
    with read_only_dir(tmp_path / "store") as root:
        env = fs_env(dsn, root)
        for args in (("enqueue", str(image)), ("run", "--burst")):
            line = one_line_error(run_cli(*args, env=env))
            assert f"fs store {root} is not writable: " in line, line
            assert "Read-only file system" in line or "Permission denied" in line
            assert "[storage] root" in line
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM archive_files").fetchone() == (0,)


def test_config_show_names_the_embedded_database(run_cli: RunCli, tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    ini = write_ini(tmp_path / "etc" / "derivd.ini", {"supervisor": {"state_dir": "../state"}})
    result = run_cli("-c", "etc/derivd.ini", "config", "show", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"state_dir = {tmp_path / 'state'}\n" in result.stdout  # against the file's folder
    embedded = (
        f"# database: the embedded PostgreSQL cluster under {tmp_path / 'state'}, not running"
    )
    assert embedded in result.stdout
    dsn = result.stdout.split("its DSN (psql, [database] dsn of another tool): ")[1].strip()
    assert psycopg.conninfo.conninfo_to_dict(dsn) == {
        "host": str(tmp_path / "state" / "sock"),
        "port": "5432",
        "user": "derivd",
        "dbname": "derivd",
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["etc"]  # nothing made
    assert ini.exists()


def test_config_show_names_the_file_it_read_and_the_environments_values(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """`config show` printed values without saying where they came from: a file in
    another directory, the defaults, or an environment variable overriding the file."""
    (tmp_path / "etc").mkdir()
    ini = write_ini(tmp_path / "etc" / "derivd.ini", {"queue": {"lease": "90"}})
    env = {"DERIVD_QUEUE_LEASE": "60", "DERIVD_QUEUE_RETRY_BASE": "2"}
    result = run_cli("-c", "etc/derivd.ini", "config", "show", cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"# read from {ini}"
    assert lines[1] == "# from the environment: DERIVD_QUEUE_LEASE, DERIVD_QUEUE_RETRY_BASE"
    at = lines.index("lease = 60")
    assert lines[at - 1] == "# (from the environment DERIVD_QUEUE_LEASE, not the file)"
    assert lines[lines.index("max_attempts = 3") - 1].startswith("# attempts per file")
    defaults = run_cli("config", "show", cwd=tmp_path / "etc")
    assert defaults.returncode == 0, defaults.stderr
    assert defaults.stdout.startswith(
        f"# no config file read: built-in defaults (etc/derivd.ini is not in {tmp_path / 'etc'}"
    )


def test_unreachable_database_is_one_line(run_cli: RunCli, tmp_path: Path) -> None:
    env = fs_env("host=127.0.0.1 port=1 user=x dbname=x connect_timeout=2", tmp_path)
    line = one_line_error(run_cli("migrate", env=env))
    assert "database unavailable" in line


def test_bucket_without_versioning_is_refused_in_one_line(  # type: ignore[no-untyped-def]
    run_cli: RunCli, dsn: str, s3_server, s3_bucket_unversioned: str
) -> None:
    env = {
        "DERIVD_DATABASE_DSN": dsn,
        "DERIVD_STORAGE_BACKEND": "s3",
        "DERIVD_STORAGE_BUCKET": s3_bucket_unversioned,
        "DERIVD_STORAGE_ENDPOINT_URL": s3_server.endpoint_url,
    }
    line = one_line_error(run_cli("run", "--burst", env=env))
    assert "versioning off" in line and s3_bucket_unversioned in line


def test_enqueue_then_burst_run_makes_everything_final(
    run_cli: RunCli, dsn: str, tmp_path: Path
) -> None:
    originals = tmp_path / "in"
    (originals / "nested").mkdir(parents=True)
    for n, size in enumerate([(640, 480), (100, 300)]):
        buffer = io.BytesIO()
        Image.new("RGB", size, (n * 90, 30, 200)).save(buffer, "PNG")
        (originals / "nested" / f"{n}.png").write_bytes(buffer.getvalue())
    (originals / "notes.jpg").write_text("not an image")
    env = fs_env(
        dsn, tmp_path / "store", DERIVD_DERIVE_BACKEND="pillow", DERIVD_SUPERVISOR_WORKERS="1"
    )

    queued = run_cli("enqueue", str(originals), env=env)
    assert queued.returncode == 0, queued.stderr
    ids = [int(line.split("\t")[0]) for line in queued.stdout.splitlines()]
    assert len(ids) == 3

    ran = run_cli("run", "--burst", "--workers", "0", env=env, timeout=120)  # 0: one per CPU
    assert ran.returncode == 0, ran.stderr
    assert "dashboard and /metrics: off (set [metrics] listen" in ran.stderr
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT status, error_code FROM archive_files ORDER BY id").fetchall()
    assert sorted(rows, key=str) == sorted(
        [("ready", None), ("ready", None), ("rejected", "unsupported_content")], key=str
    )


def test_demo_progress_counts_only_the_demos_rows(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`demo --into DSN` counted every finished row of that database as its own."""
    with QueueDB.open(dsn, role="test") as queue:
        others = queue.enqueue([(f"originals/other{i}", "v1") for i in range(3)])
        mine = queue.enqueue([("originals/mine1", "v1"), ("originals/mine2", "v1")])
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "UPDATE archive_files SET status = 'rejected', error_code = 'corrupt_content' "
            "WHERE id = ANY(%s)",
            ([*others, mine[0]],),
        )
    progress = Progress(dsn, mine, live=False)
    progress.finished.set()  # one reading, then done
    progress.run()
    assert capsys.readouterr().err.splitlines() == ["processed 1/2"]


def test_demo_processes_its_samples_and_shows_a_real_webp(
    run_cli: RunCli, dsn: str, tmp_path: Path
) -> None:
    env = fs_env(
        dsn,
        tmp_path / "store",
        DERIVD_SUPERVISOR_STATE_DIR=str(tmp_path / "state"),
        DERIVD_SUPERVISOR_WORKERS="2",
    )
    result = run_cli("demo", "--count", "3", "--into", dsn, env=env, timeout=180)
    assert result.returncode == 0, result.stderr
    assert "ready: 3  rejected: 2  other: 0" in result.stdout
    assert "rejected bad-truncated.jpg: corrupt_content" in result.stdout
    assert "rejected bad-not-an-image.jpg: unsupported_content" in result.stdout
    # Progress into a pipe: a line per change, none rewritten in place, ending complete.
    progress = [line for line in result.stderr.splitlines() if line.startswith("processed ")]
    assert progress and progress[-1] == "processed 5/5", result.stderr
    assert "\r" not in result.stderr
    example = Path(result.stdout.split("e.g. ")[1].splitlines()[0].strip())
    assert example.is_relative_to(tmp_path / "store") and example.suffix == ".webp"
    with Image.open(example) as im:
        assert im.format == "WEBP" and max(im.size) <= 1600
    # The last line names the gallery; every image it shows exists beside it.
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("gallery: ")
    page = Path(last.removeprefix("gallery: "))
    assert page == tmp_path / "state" / "demo" / "index.html"
    images = Images(page.read_text())
    with psycopg.connect(dsn) as conn:
        variants = conn.execute("SELECT count(*) FROM archive_variants").fetchone()
        analysed = conn.execute(
            "SELECT count(*) FROM archive_files WHERE status = 'ready'"
            " AND original_placeholder IS NOT NULL"
        ).fetchone()
    assert variants is not None and variants[0] >= 3 and analysed is not None
    # Each analysed original's placeholder is painted from a PNG data URI.
    placeholders = [s for s in images.sources if s.startswith("data:image/png;base64,")]
    assert len(placeholders) == analysed[0] == 3
    files = [s for s in images.sources if s not in placeholders]
    # Every original that is an image, and every variant; the one that is not an image
    # gets a labelled frame, never a broken image.
    assert len(files) == 4 + variants[0]
    assert "nothing to show" in page.read_text()
    for src in files:
        assert not Path(src).is_absolute() and ".." not in Path(src).parts, src
        assert (page.parent / src).is_file(), src
    assert images.cards == {"ready": 3, "rejected": 2}
    assert "rejected: corrupt_content" in page.read_text()
    assert "rejected: unsupported_content" in page.read_text()


def test_demo_leaves_a_configured_database_alone(
    run_cli: RunCli, dsn: str, pg_root: Path, tmp_path: Path
) -> None:
    """The demo's samples (two deliberately bad) went into whatever database the config
    named, production included; now only into the embedded one unless `--into DSN`."""
    state = pg_root / f"demo-{tmp_path.name}"
    env = fs_env(dsn, tmp_path / "configured-store", DERIVD_SUPERVISOR_STATE_DIR=str(state))
    try:
        result = run_cli("demo", "--count", "1", "--backend", "noop", env=env, timeout=180)
    finally:
        discard(state / "pg")
    assert result.returncode == 0, result.stderr
    assert f"demo: on the embedded database under {state}; [database] dsn is left alone" in (
        result.stderr
    )
    assert "ready: 3  rejected: 0  other: 0" in result.stdout  # noop reads no bytes
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM archive_files").fetchone() == (0,)
    assert not (tmp_path / "configured-store").exists()  # nor the configured store
    assert (state / "objects" / "originals").is_dir()


def test_demo_config_is_the_embedded_one_unless_told(tmp_path: Path) -> None:
    configured = (
        Config()
        .replace("database", dsn="host=prod")
        .replace("storage", backend="s3", bucket="prod")
    )
    sandbox = demo_config(configured, into=None)
    assert sandbox.database.dsn == "" and sandbox.storage.backend == "fs"
    assert sandbox.fs_root == sandbox.state_dir / "objects"
    told = demo_config(configured, into="host=staging")
    assert told.database.dsn == "host=staging" and told.storage.bucket == "prod"


def test_demo_into_must_be_a_dsn(run_cli: RunCli, tmp_path: Path) -> None:
    line = one_line_error(run_cli("demo", "--into", "host='unterminated", cwd=tmp_path))
    assert line.startswith("derivd: --into: not a libpq connection string")
    assert list(tmp_path.iterdir()) == []


class Images(HTMLParser):
    """The gallery's <img src> values and its cards by status."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.sources: list[str] = []
        self.cards: dict[str, int] = {}
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "img":
            self.sources.append(found["src"] or "")
        elif tag == "section" and found.get("class") == "card":
            status = found.get("data-status") or ""
            self.cards[status] = self.cards.get(status, 0) + 1


@pytest.mark.acceptance
def test_a_closed_stdout_ends_quietly(tmp_path: Path) -> None:
    """`derivd ... | head` where head has gone: no traceback, no BrokenPipeError noise.
    Click does this for the console script (the old `_restore_sigpipe` was never called
    from it, and SIGPIPE's default action would also kill the supervisor whenever it
    wrote to a dead worker's pipe)."""
    proc = subprocess.Popen(
        [*derivd_command(), "config", "show", "--defaults"],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    proc.stdout.close()  # the reader is gone before the first write
    _out, err = proc.communicate(timeout=60)
    assert err == ""
    assert proc.returncode == 1  # click's answer to EPIPE: quiet, and not success
