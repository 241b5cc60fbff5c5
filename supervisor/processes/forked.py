"""What every child of the supervisor does first after fork (a worker, a sweep pass):
leave the parent's process group, reset the signals it inherited, die with the parent,
and close the parent's descriptors that are not its own."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterable
from types import FrameType

from derivd.osproc import set_pdeathsig
from derivd.processes.lifecycle import EXIT_OK

StopHandler = Callable[[int, FrameType | None], None]

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
