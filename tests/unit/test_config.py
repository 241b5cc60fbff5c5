"""Settings: declared once, every one round-trips, bad values name file/section/key."""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path
from typing import get_type_hints

import pytest
from configs import write_ini

from derivd.config import SECTIONS, Config, VariantSettings
from derivd.config_checks import Bounds, ConfigError, parse_variants
from derivd.config_load import config_location, known_env_names, load_config
from derivd.config_show import example_config, render_ini, render_value
from derivd.redact import mask_dsn

REPO = Path(__file__).resolve().parents[2]


def test_every_setting_is_documented_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "derivd.ini"
    path.write_text(render_ini(), encoding="utf-8")
    loaded = load_config(path, env={})
    for name in SECTIONS:
        for spec in fields(getattr(loaded, name)):
            assert spec.metadata["doc"], f"[{name}] {spec.name} has no doc"
            default = getattr(getattr(Config(), name), spec.name)
            if spec.metadata["path"] and default:  # made absolute against the file's folder
                default = str(tmp_path / default)
            assert getattr(getattr(loaded, name), spec.name) == default


def test_example_file_is_generated_from_the_declarations() -> None:
    assert (REPO / "etc" / "derivd.ini").read_text(encoding="utf-8") == render_ini(example_config())
    # Its state is the checkout's var/, from whichever directory derivd runs.
    loaded = load_config(REPO / "etc" / "derivd.ini", env={})
    assert loaded.state_dir == REPO / "var"


def test_bad_values_name_file_section_and_key(tmp_path: Path) -> None:
    path = write_ini(
        tmp_path / "bad.ini",
        {
            "queue": {"lease": "soon", "max_attempts": "0", "listen": "maybe"},
            "derive": {"backend": "imagemagick", "varients": "thumb:320"},
            "bogus": {"x": "1"},
        },
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path, env={})
    lines = str(caught.value).splitlines()
    expected = [
        f"{path}: [queue] lease: 'soon' is not a number",
        f"{path}: [queue] max_attempts: must be between 1 and 100",
        f"{path}: [queue] listen: 'maybe' is not yes/no",
        f"{path}: [derive] varients: unknown setting",
        f"{path}: [derive] backend: unknown backend 'imagemagick'; known: ",
        f"{path}: [bogus]: unknown section; known: database, storage, ",
    ]
    for prefix in expected:
        assert any(line.startswith(prefix) for line in lines), (prefix, lines)
    assert "noop, pillow, vips" in str(caught.value)
    assert "did you mean variants?" in str(caught.value)
    assert ", logging, variant:NAME" in str(caught.value)  # the sections a file may hold
    assert "-:" not in str(caught.value)  # no placeholder for a section or key


def test_problems_name_only_what_applies(tmp_path: Path) -> None:
    """`prdo.ini: [-] -: no such file` and `[qeue] -: unknown section` named a section or
    key where none applies; a misspelled section gets the closest known one."""
    missing = tmp_path / "prdo.ini"
    with pytest.raises(ConfigError) as caught:
        load_config(missing, env={}, required=True)
    assert str(caught.value) == f"{missing}: no such file"
    path = write_ini(tmp_path / "q.ini", {"qeue": {"lease": "60"}})
    with pytest.raises(ConfigError) as caught:
        load_config(path, env={})
    assert str(caught.value).startswith(f"{path}: [qeue]: unknown section; did you mean [queue]?")
    broken = tmp_path / "broken.ini"
    broken.write_text("lease = 60\n", encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_config(broken, env={})
    assert str(caught.value).startswith(f"{broken}:1: File contains no section headers")


def test_a_misspelled_environment_variable_is_refused_with_the_closest_name() -> None:
    """DERIVD_DATABSE_DSN was ignored: a health probe went green against a fresh private
    cluster instead of the database it was meant to watch."""
    with pytest.raises(ConfigError) as caught:
        load_config(
            Path("absent.ini"), env={"DERIVD_DATABSE_DSN": "host=db", "DERIVD_NOTHING_LIKE_IT": "1"}
        )
    assert str(caught.value).splitlines() == [
        "environment DERIVD_DATABSE_DSN: unknown variable; did you mean DERIVD_DATABASE_DSN? "
        "settings come as DERIVD_<SECTION>_<KEY> (see `derivd config show`)",
        "environment DERIVD_NOTHING_LIKE_IT: unknown variable; "
        "settings come as DERIVD_<SECTION>_<KEY> (see `derivd config show`)",
    ]
    # Every declared name, DERIVD_CONFIG, and names without the prefix are accepted.
    env = _defaults_as_env() | {"DERIVD_CONFIG": "x.ini", "PGHOST": "x", "DERIVD": "x"}
    assert set(env) >= set(known_env_names())
    load_config(Path("absent.ini"), env=env)


def _defaults_as_env() -> dict[str, str]:
    """Every setting's default under its environment name."""
    return {
        f"DERIVD_{name.upper()}_{spec.name.upper()}": render_value(
            getattr(getattr(Config(), name), spec.name)
        )
        for name in SECTIONS
        for spec in fields(getattr(Config(), name))
    }


def test_the_config_file_comes_from_derivd_config(tmp_path: Path) -> None:
    path = write_ini(tmp_path / "c.ini", {"queue": {"lease": "90"}})
    assert config_location(None, {"DERIVD_CONFIG": str(path)}) == (path, True)
    assert config_location(tmp_path / "given.ini", {"DERIVD_CONFIG": str(path)})[0] == (
        tmp_path / "given.ini"
    )
    assert config_location(None, {}) == (Path("etc/derivd.ini"), False)
    assert load_config(env={"DERIVD_CONFIG": str(path)}).queue.lease == 90


def test_relative_paths_resolve_against_the_config_files_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`state_dir = var` meant ./var of wherever a command ran: `derivd status` from
    another directory started a new, empty cluster there."""
    folder = tmp_path / "conf"
    folder.mkdir()
    path = write_ini(
        folder / "derivd.ini",
        {"supervisor": {"state_dir": "state", "pidfile": "run/derivd.pid"}, "storage": {}},
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(Path("../conf/derivd.ini"), env={})
    assert config.state_dir == folder / "state"
    assert config.supervisor.pidfile == str(folder / "run" / "derivd.pid")
    assert config.fs_root == folder / "state" / "objects"
    # A default path resolves against the file too; absolute paths stay as written.
    root = tmp_path / "objects"
    write_ini(path, {"storage": {"root": str(root)}})
    config = load_config(path, env={})
    assert config.state_dir == folder / "var" and config.fs_root == root
    # A path from the environment is a command-line value: against the working directory.
    config = load_config(path, env={"DERIVD_SUPERVISOR_STATE_DIR": "here"})
    assert config.state_dir == elsewhere / "here"
    # No file: the working directory.
    assert load_config(tmp_path / "absent.ini", env={}).state_dir == elsewhere / "var"


def test_job_timeout_must_stay_well_below_the_lease(tmp_path: Path) -> None:
    path = write_ini(
        tmp_path / "t.ini", {"queue": {"lease": "60"}, "supervisor": {"job_timeout": "58"}}
    )
    with pytest.raises(ConfigError, match=r"\[supervisor\] job_timeout: .* 80% of \[queue\] lease"):
        load_config(path, env={})


def test_orphan_guard_must_outlast_the_longest_attempt(tmp_path: Path) -> None:
    """With renew = yes an attempt may PUT until job_timeout +
    kill_grace, far past the lease; a guard between the two would let the sweep delete
    objects an attempt is still writing (and they would then leak)."""
    renewed = {
        "queue": {"lease": "30", "renew": "yes"},
        "supervisor": {"job_timeout": "600", "kill_grace": "10"},
    }
    path = write_ini(tmp_path / "g.ini", {**renewed, "sweep": {"orphan_guard": "31"}})
    with pytest.raises(
        ConfigError, match=r"\[sweep\] orphan_guard: must exceed \[supervisor\] job_timeout"
    ):
        load_config(path, env={})
    path = write_ini(tmp_path / "g.ini", {**renewed, "sweep": {"orphan_guard": "610"}})
    with pytest.raises(ConfigError, match=r"orphan_guard: must exceed"):
        load_config(path, env={})
    path = write_ini(tmp_path / "g.ini", {**renewed, "sweep": {"orphan_guard": "3600"}})
    assert load_config(path, env={}).sweep.orphan_guard == 3600
    path = write_ini(
        tmp_path / "g.ini", {"queue": {"lease": "60"}, "sweep": {"orphan_guard": "60"}}
    )
    with pytest.raises(ConfigError, match=r"orphan_guard: must exceed \[queue\] lease"):
        load_config(path, env={})


def test_environment_overrides_and_is_named_in_errors(tmp_path: Path) -> None:
    path = write_ini(tmp_path / "e.ini", {"database": {"dsn": "host=file"}})
    config = load_config(path, env={"DERIVD_DATABASE_DSN": "host=env"})
    assert config.database.dsn == "host=env"
    with pytest.raises(ConfigError, match=r"environment DERIVD_QUEUE_LEASE: \[queue\] lease"):
        load_config(path, env={"DERIVD_QUEUE_LEASE": "x"})


def test_missing_explicit_file_is_an_error_but_default_is_optional(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.ini", env={}, required=True)
    assert load_config(tmp_path / "absent.ini", env={}).source == "(defaults)"


def test_variants_parse_in_order_and_reject_nonsense() -> None:
    assert [(v.name, v.long_edge) for v in parse_variants("preview:1600, thumb:320")] == [
        ("preview", 1600),
        ("thumb", 320),
    ]
    for bad in ("thumb", "thumb:0", "Thumb:10", "a:1,a:2", "../x:10"):
        with pytest.raises(ValueError):
            parse_variants(bad)


def test_passwords_are_masked() -> None:
    assert mask_dsn("host=db password=s3cret user=x") == "host=db password=*** user=x"
    assert mask_dsn("postgresql://u:s3cret@db/x") == "postgresql://u:***@db/x"


def test_every_number_has_a_finite_declared_range(tmp_path: Path) -> None:
    """`inf` and `1e300` passed `positive` and crashed later: an OverflowError in
    `max_input_mb`'s bytes, an interval PostgreSQL cannot hold for `[status] window`,
    `retry_max` or `purge_deleted_days`."""
    for name, cls in [*SECTIONS.items(), ("variant:x", VariantSettings)]:
        hints = get_type_hints(cls)
        for spec in fields(cls):
            if hints[spec.name] in (int, float):
                bounds = spec.metadata["check"]
                assert isinstance(bounds, Bounds), f"[{name}] {spec.name} declares no range"
                assert math.isfinite(bounds.high), f"[{name}] {spec.name}"
    named = {
        "derive": "max_input_mb",
        "status": "window",
        "queue": "retry_max",
        "sweep": "purge_deleted_days",
    }
    for value in ("inf", "1e300", "nan", "-inf"):
        path = write_ini(tmp_path / "big.ini", {s: {k: value} for s, k in named.items()})
        with pytest.raises(ConfigError) as caught:
            load_config(path, env={})
        found = {(p.section, p.key) for p in caught.value.problems}
        assert set(named.items()) <= found, (value, str(caught.value))
    with pytest.raises(ConfigError) as caught:
        load_config(Path("absent.ini"), env={"DERIVD_QUEUE_RETRY_MAX": "inf"})
    assert str(caught.value) == (
        "environment DERIVD_QUEUE_RETRY_MAX: [queue] retry_max: must be at most 604,800"
    )


def test_import_target_backend_is_accepted(tmp_path: Path) -> None:
    ini = tmp_path / "a.ini"
    ini.write_text("[derive]\nbackend = faulthandlers:Script\n")
    assert load_config(ini, env={}).derive.backend == "faulthandlers:Script"
    ini.write_text("[derive]\nbackend = no such thing\n")
    with pytest.raises(ConfigError, match="unknown backend"):
        load_config(ini, env={})


def test_job_timeout_must_stay_below_lease(tmp_path: Path) -> None:
    ini = tmp_path / "a.ini"
    ini.write_text("[queue]\nlease = 6\n[supervisor]\njob_timeout = 4\nkill_grace = 1\n")
    with pytest.raises(ConfigError, match="80%"):
        load_config(ini, env={})
