"""Backfill against the fleet (DESIGN.md "Changing variants"): the host registry knows
which variant set each live supervisor derives, and `derivd backfill --apply` refuses to
roll out a set they do not run (their workers would reject every re-derivation), or
warns with --force. Re-derivation jobs are logged as jobs of their file, never under a
file id that names no file."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from configs import make_config, write_ini

from derivd.ops.backfill import fleet_problem
from derivd.processes.duties import host_info, variant_set_of
from derivd.queue.db import Job, QueueDB

RunCli = Callable[..., subprocess.CompletedProcess[str]]


def test_hosts_deriving_another_set_are_a_problem_and_unknown_ones_too() -> None:
    assert fleet_problem({}, "t") is None
    assert fleet_problem({"a": "t", "b": "t"}, "t") is None
    problem = fleet_problem({"a": "t", "b": "old", "c": None}, "t")
    assert problem is not None and "live host(s) b, c derive another variant set" in problem
    many = fleet_problem({f"h{i}": "old" for i in range(8)}, "t")
    assert many is not None and "h0, h1, h2, h3, h4 and 3 more" in many


def test_a_rederivation_is_logged_as_a_job_of_its_file() -> None:
    file = Job(7, uuid.uuid4(), 1, "k", "v", 0.0)
    job = replace(file, id=53, file_id=7)
    assert file.log_fields() == {"file_id": 7}
    assert job.log_fields() == {"rederive_job": 53, "file_id": 7}
    assert (file.label, job.label) == ("file 7", "rederive job 53 of file 7")


def _register(queue: QueueDB, dsn: str, variants: str, host: str) -> None:
    config = make_config(dsn, derive={"backend": "pillow", "variants": variants})
    info = replace(host_info(config, busy=0), host=host, pid=os.getpid() + 1)
    assert queue.register_host(info) is not None


def test_the_registry_learns_each_hosts_set(dsn: str, queue: QueueDB) -> None:
    old = make_config(dsn, derive={"backend": "pillow", "variants": "thumb:64"})
    new = make_config(dsn, derive={"backend": "pillow", "variants": "thumb:32"})
    assert variant_set_of(old) != variant_set_of(new)
    info = replace(host_info(old, busy=0), host="a")
    registered = queue.register_host(info)
    assert registered is not None
    assert queue.live_variant_sets() == {"a": variant_set_of(old)}
    # A reload: the heartbeat tells the registry the new set, fenced on the run.
    assert queue.record_variant_set(replace(registered, variant_set=variant_set_of(new)))
    assert queue.live_variant_sets() == {"a": variant_set_of(new)}


def test_apply_refuses_while_live_hosts_derive_another_set(
    dsn: str, queue: QueueDB, tmp_path: Path, run_cli: RunCli
) -> None:
    (tmp_path / "store").mkdir()
    ini = write_ini(tmp_path / "derivd.ini", {
        "database": {"dsn": dsn},
        "storage": {"backend": "fs", "root": tmp_path / "store"},
        "derive": {"backend": "pillow", "variants": "thumb:32"},
    })  # fmt: skip
    _register(queue, dsn, "thumb:64", "old-host")
    refused = run_cli("-c", str(ini), "backfill", "--apply")
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert "live host(s) old-host derive another variant set" in refused.stderr
    assert "--force" in refused.stderr
    dry = run_cli("-c", str(ini), "backfill")
    assert dry.returncode == 0 and "derivd: warning: live host(s) old-host" in dry.stderr
    forced = run_cli("-c", str(ini), "backfill", "--apply", "--force")
    assert forced.returncode == 0, forced.stderr
    assert "derivd: warning: live host(s) old-host" in forced.stderr
    _register(queue, dsn, "thumb:32", "new-host")
    queue.conn.execute("DELETE FROM derivd_hosts WHERE host = 'old-host'")
    agreed = run_cli("-c", str(ini), "backfill", "--apply")
    assert agreed.returncode == 0 and "warning" not in agreed.stderr, agreed.stderr
