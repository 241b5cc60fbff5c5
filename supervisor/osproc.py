"""Small process helpers: parent-death signal, process titles, pidfile, sd_notify, RSS,
a queue for signals, a fork that spares the children's memory, an exit without teardown.

Nothing here imports anything heavy; the supervisor uses all of it before and after fork.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import gc
import os
import signal
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

PR_SET_PDEATHSIG = 1
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def set_pdeathsig(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux only).

    Returns False when prctl is not available. The caller must still check getppid():
    the parent may have died before this call, and then no signal will ever come.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


# mallopt(3) parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc maps every chunk above 128 KiB on its own and unmaps it when freed, raising that
# threshold only as big chunks come back (up to 32 MiB), and it trims the heap's free top
# beyond twice the threshold. A worker allocates and frees buffers of a few MB for every
# image (decoded pixels, Pillow's images), and in a worker that heuristic often did not
# settle: each buffer was mapped anew and faulted in page by page (bench/sharp.py: the
# Pillow backend ~1,900 minor faults and ~2.5 CPU ms per image of sharp's task). Pinned at
# its ceiling, such buffers are reused from the heap; up to 64 MiB of freed heap top stays
# with the process (the RSS recycle bound still counts it).
WORKER_MMAP_THRESHOLD = 32 << 20
WORKER_TRIM_THRESHOLD = 64 << 20


def keep_freed_heap(mmap_threshold: int = WORKER_MMAP_THRESHOLD,
                    trim_threshold: int = WORKER_TRIM_THRESHOLD) -> bool:  # fmt: skip
    """Pin glibc malloc's mmap and trim thresholds (see above). False where the C library
    has no mallopt or refuses (musl has a mallopt that does nothing and says so)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(M_TRIM_THRESHOLD, trim_threshold)
    )


def boot_without_gc() -> None:
    """Hold the cyclic GC off while a prefork parent boots, up to its first `fork`. Its
    imports allocate hundreds of thousands of objects and no garbage to speak of: the
    collections they trigger cost ~10 % of `derivd run`'s boot, on the one core the
    workers wait for."""
    gc.disable()


def fork() -> int:
    """os.fork. The first fork after `boot_without_gc` freezes what the parent built
    first and turns the GC back on in both processes: the recipe of Python's `gc.freeze`
    docs, so a child's collections never write to (and so copy) the pages it shares with
    its parent. Later forks are plain: freezing at every worker restart would make
    whatever is garbage at that moment immortal."""
    if gc.isenabled():
        return os.fork()
    gc.freeze()
    pid = os.fork()
    gc.enable()
    return pid


def exit_without_teardown(code: int) -> NoReturn:
    """Exit with `code` as the interpreter would (atexit handlers run, output flushed),
    but without freeing the heap object by object: ~40 ms of one core at the end of every
    `derivd run`, on nothing. Only with no other thread left, whose work an exit would
    cut short; else a plain `sys.exit`."""
    if threading.active_count() > 1:
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def set_proctitle(title: str) -> None:
    """Show `title` in ps/top. Titles carry roles, slots and job ids, never credentials."""
    try:
        import setproctitle
    except ImportError:  # optional nicety; the daemon works without it
        return
    setproctitle.setproctitle(title)


def rss_mb(pid: int | None = None) -> float:
    """Current resident set size in MiB (from /proc; 0.0 where that is unavailable)."""
    path = f"/proc/{pid or 'self'}/statm"
    try:
        resident = int(Path(path).read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return resident * _PAGE_SIZE / (1024 * 1024)


class PidfileError(Exception):
    """Another live process holds the pidfile, or it cannot be written."""


class Pidfile:
    """Write our pid; refuse when a live process already owns the file; remove on exit
    only if the file is still ours (a successor may have replaced it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pid = 0

    def create(self) -> None:
        other = self._read()
        if other and other != os.getpid() and pid_alive(other):
            raise PidfileError(f"pidfile {self.path}: derivd already running as pid {other}")
        self.pid = os.getpid()
        tmp = self.path.with_name(f".{self.path.name}.{self.pid}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(f"{self.pid}\n")
            tmp.replace(self.path)  # atomic: readers never see a half-written pid
        except OSError as error:
            raise PidfileError(f"pidfile {self.path}: {error.strerror}") from None

    def remove(self) -> None:
        if self.pid and self._read() == self.pid:
            with contextlib.suppress(OSError):
                self.path.unlink()

    def _read(self) -> int:
        try:
            return int(self.path.read_text().strip() or 0)
        except (OSError, ValueError):
            return 0


def pid_alive(pid: int) -> bool:
    """True when a process with this pid exists (even if it is not ours to signal)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sd_notify(message: str, env: Mapping[str, str] | None = None) -> bool:
    """Send `message` (e.g. "READY=1\\nSTATUS=...") to systemd's NOTIFY_SOCKET.

    The protocol is one datagram on an AF_UNIX socket; a leading '@' means the abstract
    namespace. Returns False when not run under Type=notify or the send failed: the
    daemon never depends on systemd being there.
    """
    address = (env if env is not None else os.environ).get("NOTIFY_SOCKET", "")
    if not address or address[0] not in "/@":
        return False
    target = "\0" + address[1:] if address[0] == "@" else address
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message.encode(), target)
    except OSError as error:
        if error.errno not in (errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN):
            raise
        return False
    return True


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC), or None when systemd
    did not ask for them (or asked another pid)."""
    env = env if env is not None else os.environ
    usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None
    return int(usec) / 1_000_000 / 2


def children_of(pid: int) -> list[int]:
    """Live (non-zombie) child pids of `pid`, from /proc (Linux)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return sorted(found)


class SignalQueue:
    """Signal handlers that only queue the signal and write to a wake-up pipe, so a
    loop blocked in select() returns at once; the loop dispatches from `pop`. Signals in
    `wake_only` (SIGCHLD) just wake it."""

    def __init__(self, signals: Sequence[int], wake_only: Sequence[int] = ()) -> None:
        self.signals = tuple(signals)
        self.wake_only = tuple(wake_only)
        self.pending: list[int] = []
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum not in self.wake_only:
            self.pending.append(signum)
        self.wake()

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self.wake_w, b"s")

    def install(self) -> None:
        for sig in (*self.signals, *self.wake_only):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def drain(self) -> None:
        """Empty the wake-up pipe (after select() said it is readable)."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_r, 4096):
                pass

    def pop(self) -> int | None:
        return self.pending.pop(0) if self.pending else None

    def fds(self) -> tuple[int, int]:
        return self.wake_r, self.wake_w
