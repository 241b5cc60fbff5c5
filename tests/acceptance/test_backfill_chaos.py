"""The backfill chaos run (bench/backfill_chaos.py) as part of the suite: a backfill to a
new variant set while workers are killed, tenants are capped (1 in flight each) and an
operator deletes and retries files; it passes only when every input ended as it should
and the history checker (harness.invariants) finds every invariant over the whole run.
Invariants, never timings: its deadlines only bound a run that would otherwise hang."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import chaos_run

BACKFILL_CHAOS = Path(__file__).resolve().parents[2] / "bench" / "backfill_chaos.py"


@pytest.mark.acceptance
@pytest.mark.slow
def test_a_backfill_under_chaos_keeps_every_invariant() -> None:
    output = chaos_run(BACKFILL_CHAOS, "--seed", "27", timeout=900)
    # The run really did its tricks (a run where nothing happened proves nothing).
    assert "SIGKILL worker" in output, output
    assert "operator: derivd delete" in output, output
    assert "operator: derivd retry --rejected" in output, output
    assert "reloaded: variants" in output, output
