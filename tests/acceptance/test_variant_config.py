"""`[variant:NAME]` sections: parsed in listed order, every mistake named in one line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from subprocess import CompletedProcess

import pytest
from configs import write_ini

from derivd.config_checks import ConfigError
from derivd.config_load import load_config
from derivd.config_show import render_ini
from derivd.handlers.base import VariantSpec

RunCli = Callable[..., CompletedProcess[str]]

GOOD = {
    "derive": {"variants": "card, thumb:320, avatar, anim"},
    "variant:card": {"size": "1200x630", "fit": "cover", "gravity": "attention",
                     "format": "avif, webp", "quality": "60"},
    "variant:avatar": {"size": "320x320", "fit": "cover", "format": "jpeg", "upscale": "yes"},
    "variant:anim": {"size": "480", "format": "webp", "lossless": "yes", "animated": "yes"},
}  # fmt: skip


def test_sections_become_specs_in_listed_order(tmp_path: Path) -> None:
    config = load_config(write_ini(tmp_path / "v.ini", GOOD), env={})
    assert config.derive_spec().variants == (
        VariantSpec("card", box=(1200, 630), fit="cover", gravity="attention",
                    formats=("avif", "webp"), quality=60),
        VariantSpec("thumb", 320),
        VariantSpec("avatar", box=(320, 320), fit="cover", formats=("jpeg",), upscale=True),
        VariantSpec("anim", 480, lossless=True, animated=True),
    )  # fmt: skip


def test_shown_config_reads_back_the_same(tmp_path: Path) -> None:
    config = load_config(write_ini(tmp_path / "v.ini", GOOD), env={})
    shown = tmp_path / "shown.ini"
    shown.write_text(render_ini(config), encoding="utf-8")
    assert load_config(shown, env={}).derive_spec() == config.derive_spec()


BAD: list[tuple[dict[str, str], str]] = [
    ({"size": "320x320", "colour": "red"}, "[variant:v] colour: unknown setting"),
    ({"size": "320x"}, "[variant:v] size: '320x' is not EDGE or WxH"),
    ({"size": "0x10"}, "[variant:v] size: '0x10': each side must be between 1"),
    ({"size": "10", "format": "gif"}, "[variant:v] format: unknown format 'gif'"),
    ({"size": "10", "format": "webp, webp"}, "[variant:v] format: a format is listed twice"),
    ({"format": "webp"}, "[variant:v] size: required"),
    ({"size": "320", "fit": "cover"}, "[variant:v] fit: cover fills a box"),
    ({"size": "320", "fit": "crop"}, "[variant:v] fit: 'crop' is not one of: inside, cover"),
    ({"size": "320", "gravity": "entropy"}, "[variant:v] gravity: only fit = cover crops"),
    ({"size": "320", "format": "jpeg", "lossless": "yes"},
     "[variant:v] lossless: lossless is for webp only, not jpeg"),
    ({"size": "320", "format": "avif, webp", "lossless": "yes"},
     "[variant:v] lossless: lossless is for webp only, not avif"),
    ({"size": "320", "format": "webp, png", "animated": "yes"},
     "[variant:v] animated: png cannot hold an animation"),
    ({"size": "320", "format": "png", "quality": "50"}, "[variant:v] quality: png is lossless"),
    ({"size": "320", "quality": "101"}, "[variant:v] quality: must be between 0 and 100"),
    ({"size": "4097x4096", "format": "webp, avif"}, "[variant:v] size: avif holds at most"),
    ({"size": "5000", "format": "avif"}, "[variant:v] size: avif holds at most"),
]  # fmt: skip


@pytest.mark.parametrize(("values", "expected"), BAD, ids=[e for _, e in BAD])
def test_each_mistake_is_one_line_with_file_section_and_key(
    tmp_path: Path, values: dict[str, str], expected: str
) -> None:
    path = write_ini(tmp_path / "bad.ini", {"derive": {"variants": "v"}, "variant:v": values})
    with pytest.raises(ConfigError) as caught:
        load_config(path, env={})
    assert any(line.startswith(f"{path}: {expected}") for line in str(caught.value).splitlines()
               ), str(caught.value)  # fmt: skip


def test_listed_names_and_sections_must_meet(tmp_path: Path) -> None:
    """An unlisted section printed `[variant:spare] -: ...`: the key to change is
    `[derive] variants`, and a bad section name has no key at all."""
    path = write_ini(tmp_path / "bad.ini", {
        "derive": {"variants": "missing, thumb:320"},
        "variant:thumb": {"size": "320"},
        "variant:spare": {"size": "320"},
        "variant:Bad Name": {"size": "320"},
    })  # fmt: skip
    with pytest.raises(ConfigError) as caught:
        load_config(path, env={})
    lines = str(caught.value).splitlines()
    for expected in (
        "[derive] variants: 'missing' has no [variant:missing] section",
        "[derive] variants: 'thumb:320': [variant:thumb] exists too",
        "[derive] variants: does not list 'spare', yet [variant:spare] exists: list it or",
        "[variant:Bad Name]: NAME must be lower-case",
    ):
        assert any(line.startswith(f"{path}: {expected}") for line in lines), (expected, lines)
    assert not any(" -:" in line for line in lines), lines


def test_config_check_prints_the_problems_and_fails(run_cli: RunCli, tmp_path: Path) -> None:
    path = write_ini(tmp_path / "bad.ini", {
        "derive": {"variants": "v"},
        "variant:v": {"size": "320", "fit": "cover", "format": "jpeg", "lossless": "yes"},
    })  # fmt: skip
    result = run_cli("-c", str(path), "config", "check")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"{path}: [variant:v] fit: cover fills a box: give size as WxH (e.g. 320x320)",
        f"{path}: [variant:v] lossless: lossless is for webp only, not jpeg",
    ]
    good = run_cli("-c", str(write_ini(tmp_path / "good.ini", GOOD)), "config", "check")
    assert good.returncode == 0, good.stderr
