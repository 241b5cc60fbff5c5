"""The backfill chaos run (harness/backfill_chaos.py) as part of the suite, at pipeline
1 (the suite's run at that depth): a backfill to a new variant set while workers are
killed, their connections cut off in commits, tenants are capped (1 in flight each) and
an operator deletes and retries files; it passes only when every input ended as it
should and the history checker (harness.invariants) finds every invariant over the
whole run. Invariants, never timings: its deadlines only bound a run that would
otherwise hang."""

from __future__ import annotations

import pytest
from helpers import chaos_run


@pytest.mark.acceptance
@pytest.mark.slow
def test_a_backfill_under_chaos_keeps_every_invariant() -> None:
    output = chaos_run(
        "harness.backfill_chaos",
        *("--seed", "27", "--pipeline", "1"),
        timeout=900,
    )
    # The run really did its tricks (a run where nothing happened proves nothing).
    assert "SIGKILL worker" in output, output
    assert "operator: derivd delete" in output, output
    assert "operator: derivd retry --rejected" in output, output
    assert "reloaded: variants" in output, output
    assert "in a commit" in output, output
