"""Who runs the embedded server, and where its files live when that user cannot reach
the state directory.

PostgreSQL refuses root, so as root every server binary runs as the `postgres` system
user, which must traverse every directory above the cluster's data, socket and log. A
state directory under /root (mode 700 in containers and cloud images) is out of its
reach, and derivd never loosens a user's own permissions. The cluster moves instead to a
private directory made for it, its *home*::

    <base>/derivd-cluster-XXXXXXXX/    owned by postgres, mode 0700
        data/  sock/  postgres.log
        owner                           the record's path (which state dir this serves)

<base> is the server user's own home directory (/var/lib/postgresql on Debian: kept
across reboots, never cleaned by tmpfiles) or else /var/tmp. `<state>/pgcluster.home`
records the home, so later runs find the same cluster; `discard_home` (make clean, test
teardown) removes it, and a home whose record has gone (its state directory was removed)
is swept the next time a home is made in the same place.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from derivd.embedded import EmbeddedError
from derivd.osproc import pid_alive

log = logging.getLogger("derivd")

RECORD_NAME: Final = "pgcluster.home"
HOME_PREFIX: Final = "derivd-cluster-"
_OWNER_NAME: Final = "owner"
# Where a home may go when the server user's own home directory is unusable; best first.
FALLBACK_BASES: tuple[Path, ...] = (Path("/var/tmp"), Path(tempfile.gettempdir()))


class EmbeddedClusterError(EmbeddedError):
    """initdb, pg_ctl or the cluster's set-up failed; the message is one line for humans."""


@dataclass(frozen=True)
class RunAs:
    """Who runs the server binaries: ourselves, or `postgres` when we are root."""

    uid: int
    gid: int
    name: str
    groups: tuple[int, ...]
    home: str

    @property
    def switch(self) -> bool:
        return self.uid != os.geteuid()

    @classmethod
    def detect(cls) -> RunAs:
        if os.geteuid() != 0:
            pw = pwd.getpwuid(os.geteuid())
            return cls(os.geteuid(), os.getegid(), pw.pw_name, tuple(os.getgroups()), pw.pw_dir)
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            raise EmbeddedClusterError(
                "running as root, but PostgreSQL refuses root and there is no 'postgres' "
                "system user to run it as (apt-get install postgresql creates one)"
            ) from None
        groups = tuple(sorted(set(os.getgrouplist(pw.pw_name, pw.pw_gid))))
        return cls(pw.pw_uid, pw.pw_gid, pw.pw_name, groups, pw.pw_dir)

    def can_traverse(self, directory: Path) -> bool:
        st = directory.stat()
        if self.uid == 0:
            return True
        if st.st_uid == self.uid:
            return bool(st.st_mode & stat.S_IXUSR)
        if st.st_gid in self.groups or st.st_gid == self.gid:
            return bool(st.st_mode & stat.S_IXGRP)
        return bool(st.st_mode & stat.S_IXOTH)

    def first_blocked(self, directory: Path) -> Path | None:
        """The outermost existing directory on the way to `directory` this user cannot
        traverse, or None when it can reach `directory`."""
        for d in reversed([directory, *directory.parents]):
            if not d.exists():
                return None  # made later by us, with our umask
            if not self.can_traverse(d):
                return d
        return None

    def chown(self, path: Path) -> None:
        if self.switch:
            os.chown(path, self.uid, self.gid, follow_symlinks=False)


# --------------------------------------------------------------------------- the record


def recorded_home(state_dir: Path) -> Path | None:
    """The home `<state>/pgcluster.home` names, or None when the cluster lives in place."""
    try:
        text = (state_dir / RECORD_NAME).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    home = Path(text)
    if not home.is_absolute() or not home.name.startswith(HOME_PREFIX):
        raise EmbeddedClusterError(f"{state_dir / RECORD_NAME} does not name a derivd cluster home")
    return home


def check_home(home: Path, run_as: RunAs) -> bool:
    """True when `home` is a private directory of the server's user; False when it is gone
    (tmp cleaning, a reboot): the caller makes a new one."""
    try:
        st = os.lstat(home)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != run_as.uid or st.st_mode & 0o077:
        raise EmbeddedClusterError(
            f"{home} is not a private (0700) directory owned by {run_as.name!r}; "
            "remove it to start a new cluster"
        )
    return True


def make_home(state_dir: Path, run_as: RunAs) -> Path:
    """Create a private home for the cluster serving `state_dir` and record it there."""
    base = _pick_base(run_as)
    sweep_orphans(base, run_as)
    home = Path(tempfile.mkdtemp(prefix=HOME_PREFIX, dir=base))  # 0700, a fresh name
    run_as.chown(home)
    record = state_dir.absolute() / RECORD_NAME
    partial = record.with_name(RECORD_NAME + ".new")
    partial.write_text(f"{home}\n", encoding="utf-8")
    os.replace(partial, record)
    # Written after the record, so a sweep never sees an owner whose record is not there yet.
    (home / _OWNER_NAME).write_text(f"{record}\n", encoding="utf-8")
    log.info("embedded PostgreSQL lives in %s (%s cannot reach %s)", home, run_as.name, state_dir)
    return home


def discard_home(state_dir: Path) -> None:
    """Remove the recorded home (its server must be stopped) and the record."""
    home = recorded_home(state_dir)
    owner = _owner_record(home) if home is not None else None
    if home is not None and owner is not None:
        with contextlib.suppress(OSError):
            if owner.samefile(state_dir / RECORD_NAME):  # it serves this state dir only
                shutil.rmtree(home, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        (state_dir / RECORD_NAME).unlink()


def _pick_base(run_as: RunAs) -> Path:
    own = Path(run_as.home)
    with contextlib.suppress(OSError):
        if own.is_dir() and own.stat().st_uid == run_as.uid and not run_as.first_blocked(own):
            return own
    for base in FALLBACK_BASES:
        with contextlib.suppress(OSError):
            if base.is_dir() and not run_as.first_blocked(base):
                return base
    places = ", ".join(str(p) for p in (own, *FALLBACK_BASES))
    raise EmbeddedClusterError(
        f"no directory {run_as.name!r} can reach for its cluster (tried {places})"
    )


# --------------------------------------------------------------------------- orphans


def _owner_record(home: Path) -> Path | None:
    try:
        return Path((home / _OWNER_NAME).read_text(encoding="utf-8").strip())
    except OSError:
        return None


def _is_orphan(home: Path, run_as: RunAs) -> bool:
    st = os.lstat(home)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != run_as.uid:
        return False  # not one of ours
    record = _owner_record(home)
    if record is None:
        return False  # being made right now, or not ours: leave it
    try:
        if Path(record.read_text(encoding="utf-8").strip()) == home:
            return False
    except FileNotFoundError:
        pass  # its state directory (or just the record) was removed
    except OSError:
        return False  # unreadable is not gone
    try:
        pid = int((home / "data" / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return True
    return not pid_alive(pid)


def sweep_orphans(base: Path, run_as: RunAs) -> None:
    """Remove homes under `base` that no record names any more and whose server is down."""
    for home in base.glob(f"{HOME_PREFIX}*"):
        with contextlib.suppress(OSError):
            if _is_orphan(home, run_as):
                log.info("removing %s: its state directory no longer records it", home)
                shutil.rmtree(home, ignore_errors=True)
