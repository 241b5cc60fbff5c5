"""The one after-fork set-up every child of the supervisor runs (derivd.processes.forked),
checked in real forked children that report back through a pipe."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import pytest

from derivd.processes.forked import become_child, exit_code, fork_child

pytestmark = pytest.mark.unit


def _in_child(body: Callable[[], bytes]) -> tuple[int, bytes]:
    """Fork; the child writes what `body` returns and exits 0. (exit code, report)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(read_end)
            os.write(write_end, body())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        report = pipe.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), report


def test_a_child_leaves_the_group_ignores_hup_and_closes_the_parents_descriptors() -> None:
    parent = os.getpid()
    inherited_r, inherited_w = os.pipe()
    stops: list[int] = []

    def on_stop(signum: int, frame: object) -> None:
        stops.append(signum)

    def body() -> bytes:
        become_child(parent, close_fds=[inherited_r, inherited_w], on_stop=on_stop)
        os.kill(os.getpid(), signal.SIGHUP)  # ignored: would kill a default child
        os.kill(os.getpid(), signal.SIGTERM)  # handled by on_stop
        try:
            os.fstat(inherited_w)
            closed = b"open"
        except OSError:
            closed = b"closed"
        own_group = os.getpgid(0) == os.getpid()
        return b"%s %d %s" % (closed, len(stops), b"group" if own_group else b"shared")

    try:
        code, report = _in_child(body)
    finally:
        os.close(inherited_r)
        os.close(inherited_w)
    assert (code, report) == (0, b"closed 1 group")


def test_a_child_whose_parent_is_already_gone_exits_at_once() -> None:
    """A parent that died before prctl took effect: no death signal would ever come."""

    def body() -> bytes:
        become_child(os.getppid() + 999_999, close_fds=())
        return b"still running"

    code, report = _in_child(body)
    assert (code, report) == (0, b"")


def test_without_a_stop_handler_sigterm_kills_as_by_default() -> None:
    def body() -> bytes:
        become_child(os.getppid(), close_fds=())
        os.kill(os.getpid(), signal.SIGTERM)
        return b"survived"

    code, report = _in_child(body)
    assert (code, report) == (-signal.SIGTERM, b"")


def test_fork_child_runs_the_body_and_exit_code_collects_it_once_it_ends() -> None:
    gate_r, gate_w = os.pipe()

    def body(parent: int, inherited: tuple[int, ...]) -> None:
        os.read(gate_r, 1)  # held until the test lets go
        os._exit(7 if parent != os.getpid() and inherited == (gate_w,) else 1)

    pid = fork_child(body, (gate_w,))
    try:
        assert exit_code(pid) is None  # still running: nothing reaped
        os.write(gate_w, b"x")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 7
        assert exit_code(pid) == 0  # already reaped elsewhere: a clean exit
    finally:
        os.close(gate_r)
        os.close(gate_w)
