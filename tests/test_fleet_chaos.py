"""The short fleet chaos run (bench/fleet_chaos.py without --full) as part of the suite:
three supervisors on one PostgreSQL and one S3, 300 valid and hostile images, a host
SIGKILLed, a host paused past the lease, PostgreSQL restarted. It starts its own
services, so it shares nothing with the other tests; its checks are the invariants of
bench/chaos.py plus the failover bound and the registry's view of the dead host."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

FLEET_CHAOS = Path(__file__).resolve().parent.parent / "bench" / "fleet_chaos.py"

pytestmark = pytest.mark.acceptance


@pytest.mark.slow
def test_three_hosts_survive_death_pause_and_a_database_restart() -> None:
    run = subprocess.run(
        [sys.executable, str(FLEET_CHAOS), "--seed", "20261201"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "RESULT: all invariants hold" in run.stdout, output
    # The run really did its tricks (a run where nothing happened proves nothing).
    assert "host death: SIGKILL h1" in run.stdout, output
    assert "host pause: SIGCONT h2" in run.stdout, output
    assert "restarting PostgreSQL" in run.stdout, output
    assert "failover (host SIGKILL -> claimed again), s: " in run.stdout, output
