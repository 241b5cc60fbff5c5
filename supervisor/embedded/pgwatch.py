"""The embedded cluster's watchdog: the server stops once no derivd process uses it.

Every derivd process that starts or adopts the embedded cluster holds a shared flock(2)
on `<state>/pgcluster.users` while it uses it (`Users`); the kernel drops it when the
process ends, however it ends (kill -9 included), and its forked children (workers, the
sweep) share it while they live. Whoever starts the server also starts this watchdog, a
process in a session of its own (a terminal's ^C, or a kill of the supervisor's process
group, leaves it alone), which waits for the exclusive lock: it gets it only once no user
is left, and then stops the server if it still runs. A clean exit stops the server
itself (the watchdog then finds it stopped and exits); after a kill -9 of its owner the
watchdog stops it, as soon as the dead supervisor's last child is gone. A process that
wants the cluster while the watchdog is stopping it waits for the shared lock, then
starts the server again (and a watchdog of its own).

The watchdog process itself is `derivd.embedded.pgwatch_main` (ensure_watchdog runs it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

from derivd.osproc import pid_alive

USERS = "pgcluster.users"
PIDFILE = "pgwatch.pid"
_MODULE = "derivd.embedded.pgwatch_main"  # the watchdog process, run with -m
# In a watchdog's command line, this release's or an earlier one's (which ran this module).
_MARK = b"derivd.embedded.pgwatch"


class Users:
    """This process's shared lock on the cluster's users file, while it uses the cluster."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / USERS
        self._fd: int | None = None

    def join(self, timeout_s: float) -> bool:
        """Take the shared lock; it waits while a watchdog stops the server. False when
        that took longer than `timeout_s`."""
        if self._fd is not None:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                self._fd = fd
                return True
            except OSError as error:
                if error.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
            if time.monotonic() > deadline:
                os.close(fd)
                return False
            time.sleep(0.05)

    def leave(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _is_watchdog(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return _MARK in cmdline


def ensure_watchdog(state_dir: Path, data_dir: Path, log_file: Path) -> None:
    """Start the watchdog of this state directory unless one runs. Called under the
    cluster's start lock, by a process that holds a shared lock (Users)."""
    pidfile = state_dir / PIDFILE
    with contextlib.suppress(OSError, ValueError):
        pid = int(pidfile.read_text().strip())
        if pid_alive(pid) and _is_watchdog(pid):
            return
    proc = subprocess.Popen(
        [sys.executable, "-m", _MODULE, str(data_dir), str(log_file)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
        cwd="/",
    )
    pidfile.write_text(f"{proc.pid}\n")
