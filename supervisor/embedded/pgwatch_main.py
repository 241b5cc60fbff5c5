"""The embedded cluster's watchdog process: waits until no derivd process uses the
cluster, then stops its server (`derivd.embedded.pgwatch` says why, and starts it).

Run as `python -m derivd.embedded.pgwatch_main DATA_DIR LOG_FILE` (ensure_watchdog does).
A module of its own because it drives the cluster (`derivd.embedded.pgcluster`), which
imports `pgwatch` to start it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from pathlib import Path

from derivd.embedded.pgcluster import EmbeddedCluster
from derivd.embedded.pgwatch import PIDFILE, USERS


def watch(data_dir: Path, log_file: Path) -> None:
    """Wait until no process uses the cluster, then stop its server if it runs."""
    cluster = EmbeddedCluster(data_dir, log_file=log_file)
    fd = os.open(cluster.state_dir / USERS, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # granted once every user has gone
        if cluster.is_running():
            with open(log_file, "a", encoding="utf-8") as log:
                log.write("--- derivd watchdog: no derivd process uses the cluster; stopping\n")
            cluster.stop("fast")
    finally:
        pidfile = cluster.state_dir / PIDFILE
        with contextlib.suppress(OSError, ValueError):
            if int(pidfile.read_text().strip()) == os.getpid():
                pidfile.unlink()  # still under the lock: never a successor's file
        os.close(fd)


if __name__ == "__main__":
    watch(Path(sys.argv[1]), Path(sys.argv[2]))
