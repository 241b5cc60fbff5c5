"""Forking the supervisor's helper children (a sweep pass, the webhook deliverer) and
collecting them, and what every child does first after fork (workers included):
leave the parent's process group, reset the signals it inherited, die with the parent,
and close the parent's descriptors that are not its own."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterable
from types import FrameType

from derivd.osproc import fork, set_pdeathsig
from derivd.processes.lifecycle import EXIT_OK

StopHandler = Callable[[int, FrameType | None], None]
# A child's body: runs right after fork with the parent's pid and the parent's
# descriptors to close; it must end with os._exit (never return into the parent's stack).
ChildBody = Callable[[int, tuple[int, ...]], None]

_RESET_SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGCHLD,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


def become_child(
    parent_pid: int, *, close_fds: Iterable[int], on_stop: StopHandler | None = None
) -> None:
    """Right after fork, before anything else. `on_stop` handles SIGTERM and SIGINT (None:
    they kill, as by default); SIGHUP is ignored (reloads are the parent's business)."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # own group: the parent kills us and our helpers as one
    for sig in _RESET_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    if on_stop is not None:
        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    set_pdeathsig(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(EXIT_OK)
    for fd in close_fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def fork_child(body: ChildBody, inherited_fds: tuple[int, ...]) -> int:
    """Fork; the child runs `body(parent_pid, inherited_fds)`. Returns the child's pid."""
    parent = os.getpid()
    pid = fork()
    if pid == 0:
        body(parent, inherited_fds)
    return pid


def exit_code(pid: int) -> int | None:
    """The exit code of child `pid` if it has ended (it is reaped now), else None. A child
    someone else reaped counts as a clean exit."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return 0
    return os.waitstatus_to_exitcode(status) if done else None
