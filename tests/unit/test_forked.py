"""The one after-fork set-up every child of the supervisor runs (derivd.processes.forked),
checked in real forked children that report back through a pipe."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
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


def _python(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)  # fmt: skip


# Reports, from the parent and from its child, whether the GC runs and how many objects
# the boot left frozen; the second fork's child tells the later, plain forks apart.
_FORK_AFTER_A_QUIET_BOOT = """
import gc, os, sys
from derivd.osproc import boot_without_gc, fork
boot_without_gc()
assert not gc.isenabled()
for n in (1, 2):
    read_end, write_end = os.pipe()
    pid = fork()
    if pid == 0:
        os.write(write_end, f"child{n} {gc.isenabled()} {gc.get_freeze_count()}".encode())
        os._exit(0)
    os.close(write_end)
    print(os.read(read_end, 100).decode(), f"parent{n} {gc.isenabled()}", gc.get_freeze_count())
    os.waitpid(pid, 0)
    kept = [[] for _ in range(5000)]  # made after the boot: never frozen
"""


def test_the_first_fork_after_a_quiet_boot_freezes_the_boot_and_turns_the_gc_back_on() -> None:
    ran = _python(_FORK_AFTER_A_QUIET_BOOT)
    assert ran.returncode == 0, ran.stderr
    first, second = (line.split() for line in ran.stdout.splitlines())
    frozen = int(first[2])
    assert frozen > 1000  # the interpreter's and derivd's objects, out of every collection
    assert first[:3] == ["child1", "True", str(frozen)]
    assert first[3] == "parent1" and first[4] == "True"
    # Later forks freeze nothing more: the boot's objects only, not the 5,000 lists made
    # between the two forks (the count moves by the few frozen objects freed since).
    assert second[0:2] == ["child2", "True"] and second[3:5] == ["parent2", "True"]
    assert abs(int(second[2]) - frozen) < 100 and abs(int(second[5]) - frozen) < 100


_EXIT_WITH = """
import atexit, sys, threading, time
from derivd.osproc import exit_without_teardown
atexit.register(lambda: print("atexit ran", flush=True))
class Noisy:
    def __del__(self) -> None:
        print("torn down", flush=True)
kept = Noisy()  # a module global: the interpreter's teardown deletes it
sys.stdout.write("buffered, not flushed ")
if sys.argv[1] == "thread":
    done = threading.Event()
    def late() -> None:
        done.wait(5)
        print("the thread finished", flush=True)
    threading.Thread(target=late).start()
    threading.Timer(0.05, done.set).start()
exit_without_teardown(3)
"""


@pytest.mark.parametrize("with_thread", [False, True])
def test_an_exit_without_teardown_keeps_the_exit_code_output_and_atexit(with_thread: bool) -> None:
    """Without the teardown, but with a thread still running it waits for it as a plain
    exit does (and then tears down)."""
    ran = _python(_EXIT_WITH, "thread" if with_thread else "alone")
    assert ran.returncode == 3, ran.stderr
    assert ran.stdout.startswith("buffered, not flushed ")
    assert "atexit ran" in ran.stdout
    assert ("the thread finished" in ran.stdout) is with_thread
    assert ("torn down" in ran.stdout) is with_thread


# A chunk's size word, just below it, carries glibc's IS_MMAPPED bit (malloc/malloc.c).
_MAPPED_OR_NOT = """
import ctypes, sys
from derivd.osproc import keep_freed_heap
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
def mapped(size: int) -> bool:
    chunk = libc.malloc(size)
    word = ctypes.c_size_t.from_address(chunk - ctypes.sizeof(ctypes.c_size_t)).value
    libc.free(ctypes.c_void_p(chunk))
    return bool(word & 2)
before = mapped(3 << 20)
pinned = keep_freed_heap() if sys.argv[1] == "pinned" else None
print(before, pinned, mapped(5 << 20), mapped(40 << 20))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
@pytest.mark.parametrize("pinned", [False, True])
def test_a_worker_keeps_freed_buffers_of_a_few_mb_in_its_heap(pinned: bool) -> None:
    """By default glibc maps a fresh 3 MB or 5 MB buffer on its own (and unmaps it when
    freed: faulted in anew next time); with keep_freed_heap, as a worker boots, it comes
    from the heap, and only buffers above the pinned 32 MiB are mapped."""
    ran = _python(_MAPPED_OR_NOT, "pinned" if pinned else "default")
    assert ran.returncode == 0, ran.stderr
    before, said, five_mb, forty_mb = ran.stdout.split()
    assert before == "True"
    if pinned:
        assert (said, five_mb, forty_mb) == ("True", "False", "True")
    else:
        assert five_mb == "True"  # 3 MB freed raised the threshold to 3 MB only
