"""The short fleet chaos run (bench/fleet_chaos.py without --full) as part of the suite:
three supervisors on one PostgreSQL and one S3, 300 valid and hostile images, a host
SIGKILLed, a host paused past the lease, PostgreSQL restarted. It starts its own
services, so it shares nothing with the other tests; its checks are the invariants of
bench/chaos.py plus the failover bound and the registry's view of the dead host."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import chaos_run

FLEET_CHAOS = Path(__file__).resolve().parents[2] / "bench" / "fleet_chaos.py"

pytestmark = pytest.mark.acceptance


@pytest.mark.slow
def test_three_hosts_survive_death_pause_and_a_database_restart() -> None:
    output = chaos_run(FLEET_CHAOS, "--seed", "20261201", timeout=900)
    # The run really did its tricks (a run where nothing happened proves nothing).
    assert "host death: SIGKILL h1" in output, output
    assert "host pause: SIGCONT h2" in output, output
    assert "restarting PostgreSQL" in output, output
    assert "failover (host SIGKILL -> claimed again), s: " in output, output
