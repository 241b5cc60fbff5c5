"""A pipelined worker's deriving-thread clock (derivd.derive_clock), on a fake clock: the
waits no pipeline hides (before the first derive, after the last) are told apart from
the ones between derives."""

from __future__ import annotations

import pytest

from derivd.derive_clock import DeriveClock, Spent


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def spend(clock: DeriveClock, time: FakeTime, what: Spent, seconds: float) -> None:
    with clock.spending(what):
        time.now += seconds


def test_waits_before_the_first_and_after_the_last_derive_are_lead_and_tail() -> None:
    time = FakeTime()
    clock = DeriveClock(time)
    spend(clock, time, Spent.ORIGINAL, 0.05)  # the first job's GET
    spend(clock, time, Spent.DERIVE, 0.25)
    spend(clock, time, Spent.ORIGINAL, 0.01)  # between: the pipeline did not hide it
    spend(clock, time, Spent.DERIVE, 0.25)
    spend(clock, time, Spent.PLACE, 0.02)  # between
    spend(clock, time, Spent.DERIVE, 0.25)
    spend(clock, time, Spent.PLACE, 0.06)  # the last job's store and commit
    spend(clock, time, Spent.PLACE, 0.01)  # a poll with nothing claimable
    fields = clock.fields()
    assert fields["derives"] == 3
    assert fields["derive_s"] == pytest.approx(0.75)
    assert fields["original_wait_s"] == pytest.approx(0.06)
    assert fields["place_wait_s"] == pytest.approx(0.09)
    assert fields["lead_s"] == pytest.approx(0.05)
    assert fields["between_s"] == pytest.approx(0.03)
    assert fields["tail_s"] == pytest.approx(0.07)


def test_a_run_that_never_derived_has_only_a_lead() -> None:
    time = FakeTime()
    clock = DeriveClock(time)
    spend(clock, time, Spent.PLACE, 0.2)
    assert clock.fields() == {
        "derives": 0,
        "derive_s": 0.0,
        "original_wait_s": 0.0,
        "place_wait_s": pytest.approx(0.2),
        "lead_s": pytest.approx(0.2),
        "between_s": 0.0,
        "tail_s": 0.0,
    }


def test_a_failed_derive_still_counts_its_time() -> None:
    time = FakeTime()
    clock = DeriveClock(time)
    with pytest.raises(RuntimeError), clock.spending(Spent.DERIVE):
        time.now += 0.1
        raise RuntimeError("decoder")
    assert clock.totals[Spent.DERIVE] == pytest.approx(0.1)
    assert clock.derives == 1
