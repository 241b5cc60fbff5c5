"""The sweep pass's logic on an in-memory queue (tests/support/fixtures/memqueue.py) and a real fs
store: batch boundaries, what is forgotten when a store fails mid-batch, the lease renewed
on the pass's clock. The same passes on PostgreSQL: tests/integration/test_sweep.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.memqueue import MemorySweepQueue

from derivd.ops.sweep import LEASE_TTL_S, Sweeper
from derivd.storage.base import StorageUnavailable
from derivd.storage.fs import FsStorage

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stored(store: FsStorage, *keys: str) -> list[str]:
    for key in keys:
        store.put(key, b"x", content_type="image/webp")
    return list(keys)


def sweeper(queue: MemorySweepQueue, store: object, clock: Clock, batch: int = 2) -> Sweeper:
    return Sweeper(
        queue,  # type: ignore[arg-type]
        store,  # type: ignore[arg-type]
        orphan_guard=60,
        delete_guard=60,
        batch=batch,
        clock=clock,
    )


def test_a_full_batch_is_followed_by_another_until_one_comes_back_short(tmp_path: Path) -> None:
    store = FsStorage(tmp_path)
    queue = MemorySweepQueue(orphans=stored(store, "derived/1/a", "derived/1/b", "derived/2/a"))
    report = sweeper(queue, store, Clock(), batch=2).run_once()
    assert report.error is None
    assert report.orphans_deleted == ["derived/1/a", "derived/1/b", "derived/2/a"]
    assert queue.orphans == [] and list(store.list_keys("derived/")) == []
    assert [c for c in queue.calls if c.startswith("forget")] == [
        "forget_orphans:2",
        "forget_orphans:1",
    ]


class FailingAfter:
    """An fs store whose deletes fail after `n` successes (a storage outage mid-batch)."""

    def __init__(self, store: FsStorage, n: int) -> None:
        self.store, self.left = store, n

    def delete_all_versions(self, key: str) -> int:
        if self.left == 0:
            raise StorageUnavailable("storage unavailable: injected")
        self.left -= 1
        return self.store.delete_all_versions(key)


def test_a_store_failing_mid_batch_forgets_only_what_is_gone(tmp_path: Path) -> None:
    store = FsStorage(tmp_path)
    keys = stored(store, "derived/1/a", "derived/1/b", "derived/1/c")
    queue = MemorySweepQueue(orphans=list(keys))
    report = sweeper(queue, FailingAfter(store, 1), Clock(), batch=3).run_once()
    assert report.error == "storage unavailable: injected"
    assert report.orphans_deleted == ["derived/1/a"]
    assert queue.orphans == ["derived/1/b", "derived/1/c"], "an entry outlives its object"
    assert sorted(store.list_keys("derived/")) == ["derived/1/b", "derived/1/c"]


def test_a_lease_that_cannot_be_renewed_stops_the_pass_before_the_next_delete(
    tmp_path: Path,
) -> None:
    store = FsStorage(tmp_path)
    queue = MemorySweepQueue(orphans=stored(store, "derived/1/a", "derived/1/b"))
    clock = Clock()

    class RefusesAfterFirst(FailingAfter):
        def delete_all_versions(self, key: str) -> int:
            deleted = self.store.delete_all_versions(key)
            clock.now += LEASE_TTL_S / 3  # time for a renewal, which is refused
            queue.renewals_refused = True
            return deleted

    report = sweeper(queue, RefusesAfterFirst(store, 0), clock, batch=5).run_once()
    assert report.error is not None and "lease lost" in report.error
    assert report.orphans_deleted == ["derived/1/a"]
    assert list(store.list_keys("derived/")) == ["derived/1/b"]
    assert queue.orphans == ["derived/1/b"]
