"""The short chaos run (bench/chaos.py without --full) as part of the suite.

It starts its own PostgreSQL, moto server, fault proxy and `derivd run`, so it shares
nothing with the other tests. Its checks are invariants (nothing lost, nothing committed
twice, nothing leaked, valid images ready, hostile ones rejected with their code), never
timings; the deadlines inside it only bound a run that would otherwise hang.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CHAOS = Path(__file__).resolve().parent.parent / "bench" / "chaos.py"


@pytest.mark.slow
def test_short_chaos_run_keeps_every_invariant() -> None:
    run = subprocess.run(
        [sys.executable, str(CHAOS), "--seed", "20240611"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "RESULT: all invariants hold" in run.stdout, output
    # The run really did its tricks (a run where nothing happened proves nothing).
    assert "froze worker" in run.stdout, output
    assert "restarting PostgreSQL" in run.stdout, output
    assert "SIGKILL worker" in run.stdout, output
