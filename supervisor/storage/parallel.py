"""Several PUTs of one attempt at once: a job's variants go out side by side.

Each PUT waits for its own round trip; one after another they add up (five variants on a
store 40 ms away: 200 ms a worker spends idle). The executor is the worker's own, made in
the process that uses it (after fork). Every PUT is waited for before this returns, also
when one fails: no PUT of an attempt is still on the wire when its failure is recorded.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass

from derivd.storage.base import Storage


@dataclass(frozen=True)
class Put:
    key: str
    data: bytes
    content_type: str
    sha256: str | None = None


def put_all(storage: Storage, puts: Sequence[Put], executor: Executor | None) -> list[str]:
    """The version id of each PUT, in order. Without an executor, or with one PUT, they run
    in this thread. The first failure in order is raised once every PUT has ended."""
    if executor is None or len(puts) <= 1:
        return [_put(storage, p) for p in puts]
    futures: list[Future[str]] = [executor.submit(_put, storage, p) for p in puts]
    errors = [f.exception() for f in futures]  # waits for every one
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return [f.result() for f in futures]


def _put(storage: Storage, put: Put) -> str:
    return storage.put(put.key, put.data, put.content_type, sha256=put.sha256)
