"""The embedded PostgreSQL cluster: a private server under the state directory.

Used by the product when `[database] dsn` is empty and by the test suite. Layout, with
`data_dir = <state>/pgdata`::

    <state>/pgdata          the cluster (owned by the user that runs the server)
    <state>/sock            private 0700 Unix socket directory
    <state>/postgres.log    server log (initdb output is appended there too)
    <state>/pgcluster.lock  flock(2) held while starting or stopping

PostgreSQL refuses to run as root, so when derivd runs as root every server binary runs
as the `postgres` system user instead; when that user cannot reach the state directory,
data, socket and log move to a private home recorded in `<state>/pgcluster.home`
(pghome.py).

One job past 450 lines: one private cluster's life (place, init, start, adopt, stop) under its lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Final, Literal

import psycopg
from psycopg.conninfo import make_conninfo

from derivd.embedded import pghome
from derivd.embedded.pgbin import find_server_bindir
from derivd.embedded.pghome import EmbeddedClusterError, RunAs
from derivd.embedded.pgwatch import Users, ensure_watchdog
from derivd.osproc import pid_alive
from derivd.queue.db import ClusterAdmin

__all__ = ["EmbeddedCluster", "EmbeddedClusterError", "discard"]

log = logging.getLogger("derivd")

SUPERUSER: Final = "derivd"
DEFAULT_DB: Final = "derivd"
# sun_path is 108 bytes including the terminating NUL.
_MAX_SOCKET_PATH: Final = 107
_SOCKET_NAME_MAX: Final = len("/.s.PGSQL.65535")
_NO_TCP_PORT: Final = 5432  # only names the socket file when TCP is off
_START_TIMEOUT_S: Final = 60
_LOCK_TIMEOUT_S: Final = 120.0
_CONF_NAME: Final = "derivd.conf"

StopMode = Literal["smart", "fast", "immediate"]


# --------------------------------------------------------------------------- cluster


def _pick_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _quote_conf(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


class EmbeddedCluster:
    """A private PostgreSQL cluster in `data_dir`, reachable only by its owner.

    `fast=True` trades durability for speed (tests only): no fsync at initdb or at run
    time, no synchronous commit, no full page writes.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        port: int | None = None,
        listen_tcp: bool = False,
        log_file: Path | None = None,
        fast: bool = False,
        settings: Mapping[str, str] | None = None,
        bindir: Path | None = None,
        watchdog: bool = False,
    ) -> None:
        self.state_dir = Path(data_dir).absolute().parent
        self._in_place = (
            Path(data_dir).absolute(),
            Path(log_file).absolute() if log_file else self.state_dir / "postgres.log",
        )
        self.listen_tcp = listen_tcp
        self.fast = fast
        self.settings = dict(settings or {})
        self._bindir = bindir
        self._port_requested = port
        self._port: int | None = port
        self._started_here = False
        self._run_as: RunAs | None = None
        # The product's cluster: its server stops once no derivd process uses it, also
        # after a kill -9 of the one that started it (pgwatch). Tests' clusters: off.
        self._users = Users(self.state_dir) if watchdog else None
        self._use_home(pghome.recorded_home(self.state_dir))

    # -- public API

    @property
    def port(self) -> int:
        if self._port is None:
            raise EmbeddedClusterError(f"cluster in {self.data_dir} has not been started")
        return self._port

    @property
    def socket_dir(self) -> Path:
        return self._socket_dir

    @property
    def bindir(self) -> Path:
        if self._bindir is None:
            self._bindir = find_server_bindir()
        return self._bindir

    def start(self) -> None:
        """initdb on first use, start the server (or adopt a running one), create `derivd`.
        With `watchdog`, this process counts as a user of the cluster until it ends or
        leaves the context, and a watchdog stops the server once no user is left."""
        run_as = self._identity()
        self._join_users()
        try:
            with self._locked():
                self._place(run_as)
                self._prepare_dirs(run_as)
                if not self.exists():
                    self._initdb(run_as)
                if not self._adopt_running():
                    self._start_server(run_as)
                    self._started_here = True
                if self._users is not None:
                    ensure_watchdog(self.state_dir, *self._in_place)
                self._ensure_database(DEFAULT_DB)
        except BaseException:
            if self._users is not None:
                self._users.leave()
            raise

    def stop(self, mode: StopMode = "fast") -> None:
        """Stop the server if it runs; a no-op otherwise."""
        if mode not in ("smart", "fast", "immediate"):
            raise ValueError(f"unknown stop mode {mode!r}")
        run_as = self._identity()
        with self._locked():
            if not self.is_running():
                return
            self._run(
                run_as,
                [
                    str(self.bindir / "pg_ctl"),
                    "stop",
                    "-D",
                    str(self.data_dir),
                    "-m",
                    mode,
                    "-w",
                    "-t",
                    str(_START_TIMEOUT_S),
                ],
                what="pg_ctl stop",
            )
        self._started_here = False

    def is_running(self) -> bool:
        return self._live_pidfile() is not None

    def _live_pidfile(self) -> list[str] | None:
        """postmaster.pid's lines while its server process lives, else None."""
        fields = self._read_pidfile()
        return fields if fields is not None and pid_alive(int(fields[0])) else None

    def exists(self) -> bool:
        """Whether initdb has made this cluster (in place or in its recorded home)."""
        return (self.data_dir / "PG_VERSION").exists()

    def peek_dsn(self) -> tuple[str, bool]:
        """(DSN, running) without starting or creating anything: the running server's
        address from its pidfile, else the one start() would give it (no TCP only)."""
        fields = self._live_pidfile()
        if fields is not None:
            host, port = fields[4].strip() or "127.0.0.1", fields[3].strip()
        else:
            host = "127.0.0.1" if self.listen_tcp else str(self._socket_dir)
            port = str(self._port or _NO_TCP_PORT)
        running = fields is not None
        return make_conninfo(host=host, port=port, user=SUPERUSER, dbname=DEFAULT_DB), running

    def dsn(self, dbname: str = DEFAULT_DB) -> str:
        host = "127.0.0.1" if self.listen_tcp else str(self._socket_dir)
        return make_conninfo(host=host, port=str(self.port), user=SUPERUSER, dbname=dbname)

    def create_database(self, name: str, template: str | None = None) -> None:
        with self._admin() as conn:
            ClusterAdmin(conn).create_database(name, template)

    def drop_database(self, name: str) -> None:
        with self._admin() as conn:
            ClusterAdmin(conn).drop_database(name)

    def __enter__(self) -> EmbeddedCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # A cluster adopted from another process is left running for its owner.
        try:
            if self._started_here:
                self.stop()
        finally:
            if self._users is not None:
                self._users.leave()

    def __repr__(self) -> str:
        return f"EmbeddedCluster({str(self.data_dir)!r}, port={self._port})"

    # -- set-up

    def _join_users(self) -> None:
        if self._users is not None and not self._users.join(_LOCK_TIMEOUT_S):
            raise EmbeddedClusterError(
                f"timed out waiting for {self._users.path} (the watchdog is stopping this cluster)"
            )

    def _identity(self) -> RunAs:
        if self._run_as is None:
            self._run_as = RunAs.detect()
        return self._run_as

    def _use_home(self, home: Path | None) -> None:
        """Data, socket and log inside `home`, or where the caller asked when None."""
        self.home = home
        if home is None:
            self.data_dir, self.log_file = self._in_place
            self._socket_dir = self._choose_socket_dir()
        else:
            self.data_dir, self.log_file = home / "data", home / "postgres.log"
            self._socket_dir = home / "sock"

    def _place(self, run_as: RunAs) -> None:
        # Under the lock, so that two processes on one state dir agree on one home.
        home = pghome.recorded_home(self.state_dir)
        if home is not None and not pghome.check_home(home, run_as):
            log.warning("embedded PostgreSQL's home %s is gone; starting a new cluster", home)
            pghome.discard_home(self.state_dir)
            home = None
        if home is None and run_as.switch and self._out_of_reach(run_as):
            home = pghome.make_home(self.state_dir, run_as)
        self._use_home(home)

    def _out_of_reach(self, run_as: RunAs) -> bool:
        """True when the server's user could not reach a new cluster in place. An existing
        one stays where it is (moving it would start an empty one); _prepare_dirs names
        what blocks it."""
        self._use_home(None)
        if (self.data_dir / "PG_VERSION").exists():
            return False
        dirs = (self.data_dir.parent, self.log_file.parent, self._socket_dir.parent)
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        return any(run_as.first_blocked(d) is not None for d in dirs)

    def _choose_socket_dir(self) -> Path:
        preferred = self.state_dir / "sock"
        if len(os.fsencode(str(preferred))) + _SOCKET_NAME_MAX <= _MAX_SOCKET_PATH:
            return preferred
        # Too long for sun_path: a short directory under /tmp, stable per data dir so that
        # a restart (or another derivd process) finds the same socket.
        digest = hashlib.sha256(os.fsencode(str(self.data_dir))).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"derivd-pg-{os.geteuid()}-{digest}"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        # Two derivd processes on one state dir must not both initdb or both start.
        self.state_dir.mkdir(parents=True, exist_ok=True)
        lock = self.state_dir / "pgcluster.lock"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            deadline = time.monotonic() + _LOCK_TIMEOUT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                    if time.monotonic() > deadline:
                        raise EmbeddedClusterError(
                            f"timed out waiting for {lock} "
                            "(another derivd is starting or stopping this cluster)"
                        ) from None
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)

    def _prepare_dirs(self, run_as: RunAs) -> None:
        self._check_traversable(run_as, self.data_dir.parent)
        self._check_traversable(run_as, self.log_file.parent)
        self._check_traversable(run_as, self._socket_dir.parent)
        if not self.data_dir.exists():
            self.data_dir.mkdir(mode=0o700)
            run_as.chown(self.data_dir)
        elif run_as.switch and not any(self.data_dir.iterdir()):
            run_as.chown(self.data_dir)  # an empty dir made by root: hand it over
        self._prepare_socket_dir(run_as)
        # The server (not us) appends to the log, and may not be allowed to create it.
        fd = os.open(self.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        os.close(fd)
        run_as.chown(self.log_file)

    def _check_traversable(self, run_as: RunAs, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        blocked = run_as.first_blocked(directory)
        if blocked is not None:
            raise EmbeddedClusterError(
                f"user {run_as.name!r} cannot traverse {blocked} (needed to reach "
                f"{self.data_dir}); choose a state directory it can reach"
            )

    def _prepare_socket_dir(self, run_as: RunAs) -> None:
        # Trust authentication is safe only because nobody but the server's owner (and
        # root) can enter this directory, hence reach the socket in it. TCP (listen_tcp,
        # tests only) is open to every local user: never enable it in production.
        with contextlib.suppress(FileExistsError):
            os.mkdir(self._socket_dir, 0o700)
            run_as.chown(self._socket_dir)
        st = os.lstat(self._socket_dir)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != run_as.uid:
            raise EmbeddedClusterError(
                f"socket directory {self._socket_dir} is not a directory owned by "
                f"{run_as.name!r}; remove it and start again"
            )
        if st.st_mode & 0o077:
            os.chmod(self._socket_dir, 0o700)

    def _initdb(self, run_as: RunAs) -> None:
        argv = [
            str(self.bindir / "initdb"),
            "-D",
            str(self.data_dir),
            "--auth=trust",
            "-U",
            SUPERUSER,
            "--encoding=UTF8",
            "--no-locale",
        ]
        if self.fast:
            argv.append("--no-sync")
        self._run(run_as, argv, what="initdb", log_output=True)
        conf = self.data_dir / "postgresql.conf"
        with conf.open("a", encoding="utf-8") as f:
            f.write(
                f"\n# derivd's settings, rewritten at every start\ninclude_if_exists = "
                f"{_quote_conf(_CONF_NAME)}\n"
            )

    def _write_conf(self, run_as: RunAs) -> None:
        conf: dict[str, str] = {
            "listen_addresses": _quote_conf("127.0.0.1" if self.listen_tcp else ""),
            "port": str(self.port),
            "unix_socket_directories": _quote_conf(str(self._socket_dir)),
            "unix_socket_permissions": "0700",
        }
        if self.fast:
            conf.update(fsync="off", synchronous_commit="off", full_page_writes="off")
        conf.update(self.settings)
        path = self.data_dir / _CONF_NAME
        path.write_text("".join(f"{k} = {v}\n" for k, v in conf.items()), encoding="utf-8")
        run_as.chown(path)

    def _read_pidfile(self) -> list[str] | None:
        try:
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
        except (FileNotFoundError, PermissionError):
            return None
        if len(lines) < 6 or not lines[0].strip().isdigit():
            return None
        return lines

    def _adopt_running(self) -> bool:
        fields = self._live_pidfile()
        if fields is None:
            return False
        port, sockdir, listen = int(fields[3]), fields[4].strip(), fields[5].strip()
        if self.listen_tcp and not listen:
            raise EmbeddedClusterError(
                f"PostgreSQL already runs in {self.data_dir} without TCP; stop it first"
            )
        if self._port_requested is not None and port != self._port_requested:
            raise EmbeddedClusterError(
                f"PostgreSQL already runs in {self.data_dir} on port {port}, "
                f"not {self._port_requested}; stop it first"
            )
        self._port = port
        if sockdir:
            self._socket_dir = Path(sockdir)
        return True

    def _start_server(self, run_as: RunAs) -> None:
        attempts = 3 if self._port_requested is None and self.listen_tcp else 1
        for attempt in range(attempts):
            if self._port is None:
                self._port = _pick_free_port() if self.listen_tcp else _NO_TCP_PORT
            self._write_conf(run_as)
            log_size = self.log_file.stat().st_size
            try:
                self._run(
                    run_as,
                    [
                        str(self.bindir / "pg_ctl"),
                        "start",
                        "-D",
                        str(self.data_dir),
                        "-l",
                        str(self.log_file),
                        "-w",
                        "-t",
                        str(_START_TIMEOUT_S),
                    ],
                    what="pg_ctl start",
                    new_session=True,  # the terminal's ^C is for derivd, which stops us
                )
                return
            except EmbeddedClusterError:
                # A port picked by us may have been taken since: pick another.
                if attempt + 1 < attempts and "already in use" in self._log_since(log_size):
                    self._port = None
                    continue
                raise

    def _ensure_database(self, name: str) -> None:
        with self._admin() as conn:
            admin = ClusterAdmin(conn)
            if not admin.database_exists(name):
                # Another client may create it meanwhile (the lock covers derivd only).
                with contextlib.suppress(
                    psycopg.errors.DuplicateDatabase, psycopg.errors.UniqueViolation
                ):
                    admin.create_database(name)

    def _admin(self) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(self.dsn("postgres"), autocommit=True, connect_timeout=10)

    # -- subprocesses

    def _run(
        self,
        run_as: RunAs,
        argv: list[str],
        *,
        what: str,
        log_output: bool = False,
        new_session: bool = False,
    ) -> None:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LC_ALL": "C",
            "LANG": "C",
            "HOME": run_as.home,
            "USER": run_as.name,
            "LOGNAME": run_as.name,
        }
        log_size = self.log_file.stat().st_size if self.log_file.exists() else 0
        try:
            proc = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                env=env,
                cwd="/",
                timeout=_START_TIMEOUT_S + 30,
                start_new_session=new_session,
                check=False,
                # subprocess drops privileges after fork: setgroups, setgid, setuid.
                user=run_as.uid if run_as.switch else None,
                group=run_as.gid if run_as.switch else None,
                extra_groups=list(run_as.groups) if run_as.switch else None,
            )
        except (OSError, subprocess.SubprocessError) as e:
            raise EmbeddedClusterError(f"{what} could not run: {e}; see {self.log_file}") from None
        if log_output or proc.returncode != 0:
            with self.log_file.open("a", encoding="utf-8") as f:
                _append(f, f"--- {what} (exit {proc.returncode})", proc.stdout, proc.stderr)
        if proc.returncode != 0:
            reason = (
                _last_problem(self._log_since(log_size))
                or _last_problem(proc.stderr)
                or _last_line(proc.stderr)
                or _last_line(proc.stdout)
                or "no output"
            )
            raise EmbeddedClusterError(
                f"{what} failed for {self.data_dir} (exit {proc.returncode}): {reason}; "
                f"see {self.log_file}"
            )

    def _log_since(self, offset: int) -> str:
        try:
            with self.log_file.open("rb") as f:
                f.seek(offset)
                return f.read(64 * 1024).decode("utf-8", "replace")
        except OSError:
            return ""


def discard(data_dir: Path) -> None:
    """Stop the cluster of `data_dir` if it runs and remove its home outside the state
    directory, if it has one (make clean, test teardown); the state dir is the caller's."""
    cluster = EmbeddedCluster(data_dir)
    if cluster.is_running():
        cluster.stop("immediate")
    pghome.discard_home(cluster.state_dir)


def _append(f: IO[str], header: str, *chunks: str) -> None:
    f.write(header + "\n")
    for chunk in chunks:
        if chunk:
            f.write(chunk if chunk.endswith("\n") else chunk + "\n")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _last_problem(text: str) -> str:
    lines = [
        line.strip()
        for line in text.splitlines()
        if re.search(r"\b(FATAL|PANIC|ERROR|error)\b|initdb: error", line)
    ]
    return lines[-1] if lines else ""
