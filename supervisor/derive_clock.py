"""Where a worker's deriving thread spends its time (`derivd.worker_loop`).

The thread that derives is the worker's core: while it waits for a claimed job's
original (its GET not in yet) or for a place in the pipeline (every held job storing or
committing, nothing to derive), the core waits on the store. The clock adds those waits
up, apart from the derives, and tells the ones no pipeline can hide, the wait before a
run's first derive (a claim and one GET) and the one after its last (the last job's
store and commit), from the waits between derives, which a deep enough pipeline makes
nil. A worker logs the totals as it stops (event `pipeline time`);
bench/store_latency.py reads them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum


class Spent(StrEnum):
    DERIVE = "derive"
    ORIGINAL = "original_wait"  # the next job to derive is claimed, its GET not in yet
    PLACE = "place_wait"  # every held job is storing or committing


class DeriveClock:
    """Totals for one run of a deriving thread (not thread-safe: that thread's own)."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self.totals = dict.fromkeys(Spent, 0.0)
        self.derives = 0
        self.lead_s = 0.0  # waits before the first derive
        self._since_derive = 0.0  # waits since the last derive ended: the tail, at the end

    @contextmanager
    def spending(self, what: Spent) -> Iterator[None]:
        """Count the time the `with` block takes as `what`."""
        start = self._now()
        try:
            yield
        finally:
            spent = self._now() - start
            self.totals[what] += spent
            if what is Spent.DERIVE:
                self.derives += 1
                self._since_derive = 0.0
            elif self.derives:
                self._since_derive += spent
            else:
                self.lead_s += spent

    @property
    def tail_s(self) -> float:
        """Waits after the last derive (so far)."""
        return self._since_derive

    @property
    def between_s(self) -> float:
        """Waits between the first derive's start and the last one's end."""
        waited = self.totals[Spent.ORIGINAL] + self.totals[Spent.PLACE]
        return max(waited - self.lead_s - self.tail_s, 0.0)

    def fields(self) -> dict[str, float | int]:
        """The `pipeline time` event's fields, seconds."""
        return {
            "derives": self.derives,
            **{f"{what}_s": self.totals[what] for what in Spent},
            "lead_s": self.lead_s,
            "between_s": self.between_s,
            "tail_s": self.tail_s,
        }
