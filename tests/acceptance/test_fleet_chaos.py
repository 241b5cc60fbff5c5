"""The short fleet chaos run (harness/fleet_chaos.py without --full) as part of the
suite: three supervisors at pipeline 2 on one PostgreSQL (through PgBouncer) and one S3,
300 valid and hostile images, a host SIGKILLed, a host paused past the lease,
PostgreSQL restarted, workers' connections cut off in commits, a worker killed with a
job waiting behind its running one. It starts its own services, so it shares nothing
with the other tests; its checks are those of harness/chaos_checks.py plus the
failover bound and the registry's view of the dead host."""

from __future__ import annotations

import pytest
from fixtures.pgbouncer import NO_PGBOUNCER, find_pgbouncer
from helpers import chaos_run

pytestmark = pytest.mark.acceptance


@pytest.mark.slow
@pytest.mark.skipif(find_pgbouncer() is None, reason=NO_PGBOUNCER)
def test_three_hosts_survive_death_pause_and_a_database_restart() -> None:
    output = chaos_run("harness.fleet_chaos", "--seed", "20261201", timeout=900)
    # The run really did its tricks (a run where nothing happened proves nothing).
    assert "host death: SIGKILL h1" in output, output
    assert "host pause: SIGCONT h2" in output, output
    assert "restarting PostgreSQL" in output, output
    assert "failover (host SIGKILL -> claimed again), s: " in output, output
    assert "in a commit" in output, output
    assert "wait behind running jobs" in output, output
