"""Fault-injection handlers for supervisor tests: `[derive] backend = faulthandlers:Script`.

The original's bytes are the script, so one supervisor runs jobs with different faults:

    ok                   succeed at once (derives nothing, like noop)
    sleep 2.5            sleep, then succeed
    hang                 never return (only the supervisor's deadline ends it)
    hang-once PATH       hang if PATH does not exist yet (creating it); else succeed
    gate PATH            create PATH.started, wait until PATH exists, then succeed
    exit 7               end the worker process with status 7
    kill                 SIGKILL the worker process itself
    alloc 200            keep 200 MiB resident (touched, so RSS counts it), then succeed
    analysis {JSON}      succeed with this analysis of the original (derivd.handlers.base
                         Analysis fields), whatever it holds: malformed ones included
    corrupt              a content error (corrupt_content: rejected at once)
    fail-once PATH       a transient error if PATH does not exist yet (creating it), so
                         the row is retried after [queue] retry_base; else succeed

`Script` derives nothing; `Stamped` runs the same script, then returns one small object
per configured variant and format (bytes naming the variant and its size), so variant
sets can be stored, swapped and compared without decoding images.

Subprocesses find this module through PYTHONPATH=<repo>/tests.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

from derivd.errors import Transient
from derivd.handlers.base import Analysis, CorruptContent, Derivation, DerivedVariant, DeriveSpec

_HELD: list[bytes] = []  # memory an `alloc` job keeps alive until the worker exits


class Script:
    name = "faults"

    def __init__(self, spec: DeriveSpec | None = None) -> None:
        self.spec = spec

    def derive(self, original: bytes, spec: DeriveSpec) -> Derivation:
        verb, _, arg = original.decode().strip().partition(" ")
        if verb == "analysis":
            return Derivation([], Analysis(**json.loads(arg)))
        if verb == "sleep":
            time.sleep(float(arg))
        elif verb == "hang":
            threading.Event().wait()
        elif verb == "hang-once":
            marker = Path(arg)
            if not marker.exists():
                marker.touch()
                threading.Event().wait()
        elif verb == "gate":
            Path(arg + ".started").touch()
            while not Path(arg).exists():  # the test opens the gate with a file
                time.sleep(0.01)
        elif verb == "exit":
            os._exit(int(arg))
        elif verb == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif verb == "alloc":
            _HELD.append(b"x" * (int(arg) * 1024 * 1024))
        elif verb == "corrupt":
            raise CorruptContent("the script says so")
        elif verb == "fail-once":
            marker = Path(arg)
            if not marker.exists():
                marker.touch()
                raise Transient("the script says: not now")
        elif verb != "ok":
            raise ValueError(f"unknown fault script {verb!r}")
        return Derivation([])


class Stamped(Script):
    name = "stamped"

    def derive(self, original: bytes, spec: DeriveSpec) -> list[DerivedVariant]:
        super().derive(original, spec)
        edge = lambda v: v.box or (v.long_edge, v.long_edge)  # noqa: E731
        return [
            DerivedVariant.of(v.name, f"{v.name}.{fmt} {edge(v)}".encode(), *edge(v), fmt)
            for v in spec.variants
            for fmt in v.formats
        ]


class Partial(Stamped):
    """`Stamped` with the first configured variant and format only: a backend that
    returns fewer variants than the configuration asks for."""

    name = "partial"

    def derive(self, original: bytes, spec: DeriveSpec) -> list[DerivedVariant]:
        return super().derive(original, spec)[:1]
