"""Settings: declared once, every one round-trips, bad values name file/section/key."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
from configs import write_ini

from derivd.config import (
    SECTIONS,
    Config,
    ConfigError,
    load_config,
    mask_dsn,
    parse_variants,
    render_ini,
)

REPO = Path(__file__).resolve().parents[1]


def test_every_setting_is_documented_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "derivd.ini"
    path.write_text(render_ini(), encoding="utf-8")
    loaded = load_config(path, env={})
    for name in SECTIONS:
        for spec in fields(getattr(loaded, name)):
            assert spec.metadata["doc"], f"[{name}] {spec.name} has no doc"
            assert getattr(getattr(loaded, name), spec.name) == getattr(
                getattr(Config(), name), spec.name
            )


def test_example_file_is_generated_from_the_declarations() -> None:
    assert (REPO / "etc" / "derivd.ini").read_text(encoding="utf-8") == render_ini()


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
        f"{path}: [bogus] -: unknown section",
    ]
    for prefix in expected:
        assert any(line.startswith(prefix) for line in lines), (prefix, lines)
    assert "noop, pillow, vips" in str(caught.value)


def test_job_timeout_must_stay_well_below_the_lease(tmp_path: Path) -> None:
    path = write_ini(
        tmp_path / "t.ini", {"queue": {"lease": "60"}, "supervisor": {"job_timeout": "58"}}
    )
    with pytest.raises(ConfigError, match=r"\[supervisor\] job_timeout: .* 80% of \[queue\] lease"):
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
