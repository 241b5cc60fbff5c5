"""`[webhook:NAME]` sections: validated like every other section, the secret
from the file, the environment or a file of its own, never printed; a bad endpoint is
refused by `config check` and at start, exit 2, naming file, section and key. And the
delivery decisions, which are pure (derivd.webhooks.policy)."""

from __future__ import annotations

import base64
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from configs import write_ini

from derivd.config_checks import ConfigError
from derivd.config_load import load_config
from derivd.webhooks.policy import BACKOFF_CAP_S, Response, backoff, decide, retry_after_s

RunCli = Callable[..., subprocess.CompletedProcess[str]]
KEY = b"0123456789abcdef0123456789abcdef"
SECRET = "whsec_" + base64.b64encode(KEY).decode()


def ini(tmp_path: Path, **webhook: object) -> Path:
    return write_ini(tmp_path / "derivd.ini", {"webhook:app": webhook})


def test_an_endpoint_with_an_inline_secret(tmp_path: Path) -> None:
    config = load_config(ini(tmp_path, url="https://example.com/h", secret=SECRET,
                             events="file.ready", tenants="a, b"), env={})  # fmt: skip
    [endpoint] = config.webhooks
    assert (endpoint.name, endpoint.url, endpoint.key) == ("app", "https://example.com/h", KEY)
    assert (endpoint.events, endpoint.tenants) == (("file.ready",), ("a", "b"))
    assert SECRET not in repr(endpoint)


def test_the_secret_from_the_environment_or_a_file(tmp_path: Path) -> None:
    config = load_config(ini(tmp_path, url="http://h/", secret_env="HOOK_SECRET"),
                         env={"HOOK_SECRET": SECRET})  # fmt: skip
    assert config.webhooks[0].key == KEY
    (tmp_path / "secret").write_text(SECRET + "\n")
    config = load_config(ini(tmp_path, url="http://h/", secret_file="secret"), env={})
    assert config.webhooks[0].key == KEY


@pytest.mark.parametrize(
    ("settings", "key", "words"),
    [
        ({"url": "ftp://h/", "secret": SECRET}, "url", "http:// or https://"),
        ({"url": "http://h/"}, "secret", "required"),
        ({"url": "http://h/", "secret": SECRET, "events": "file.readyy"}, "events", "unknown"),
        ({"url": "http://h/", "secret": "whsec_!!!notbase64"}, "secret", "whsec_"),
        ({"url": "http://h/", "secret": "plain"}, "secret", "whsec_"),
        ({"url": "http://h/", "secret_env": "NOT_SET"}, "secret_env", "NOT_SET is not set"),
        ({"url": "http://h/", "secret_file": "nope"}, "secret_file", "cannot read"),
        ({"url": "http://h/", "secret": SECRET, "secret_env": "X"}, "secret_env", "exactly one"),
        ({"url": "http://h/", "secret": SECRET, "timeout": "0"}, "timeout", "greater than 0"),
    ],
)
def test_a_bad_endpoint_is_named_by_file_section_and_key(
    tmp_path: Path, settings: dict[str, str], key: str, words: str
) -> None:
    path = ini(tmp_path, **settings)
    with pytest.raises(ConfigError) as raised:
        load_config(path, env={}).signing()  # a secret not read: refused where derivd signs
    text = str(raised.value)
    assert text.startswith(f"{path}: [webhook:app] {key}: "), text
    assert words in text
    assert "notbase64" not in text and "plain" not in text.replace("explain", "")


def test_config_check_and_run_refuse_a_bad_endpoint_with_exit_2(
    tmp_path: Path, run_cli: RunCli
) -> None:
    path = ini(tmp_path, url="ftp://h/", secret="whsec_c2VjcmV0IHRoYXQgbXVzdCBub3Qgc2hvdw==")
    for args in (("config", "check"), ("run", "--burst")):
        done = run_cli("-c", str(path), *args)
        assert done.returncode == 2, done.stderr
        assert "[webhook:app] url: must be an http:// or https:// URL" in done.stderr
        assert "c2VjcmV0" not in done.stderr + done.stdout


def test_config_show_masks_the_secret(tmp_path: Path, run_cli: RunCli) -> None:
    path = ini(tmp_path, url="https://example.com/h", secret=SECRET)
    done = run_cli("-c", str(path), "config", "show")
    assert done.returncode == 0, done.stderr
    assert "[webhook:app]" in done.stdout and "secret = ***" in done.stdout
    assert SECRET.removeprefix("whsec_")[:12] not in done.stdout


# -- the decisions ----------------------------------------------------------------------


def decided(response: Response, *, attempt: int = 1, age_s: float = 0.0,
            rand: float = 0.5) -> tuple[str, float]:  # fmt: skip
    d = decide(response, attempt=attempt, age_s=age_s, horizon_s=100.0, base_s=5.0, now=0.0,
               rand=lambda: rand)  # fmt: skip
    return d.status, d.delay_s


def test_2xx_is_delivered_and_410_fails_at_once() -> None:
    assert decided(Response(200))[0] == decided(Response(299))[0] == "delivered"
    assert decided(Response(410)) == ("failed", 0.0)


def test_other_outcomes_back_off_with_full_jitter_until_the_horizon() -> None:
    assert decided(Response(500), attempt=1, rand=1.0) == ("pending", 5.0)
    assert decided(Response(None, "timeout"), attempt=3, rand=0.5) == ("pending", 10.0)
    assert decided(Response(302), attempt=1, rand=0.0) == ("pending", 0.0)
    assert decided(Response(500), attempt=3, age_s=85, rand=1.0) == ("failed", 0.0)
    assert backoff(40, 5.0, lambda: 1.0) == BACKOFF_CAP_S


def test_retry_after_is_honoured_on_429_and_503_only() -> None:
    assert decided(Response(429, retry_after="7")) == ("pending", 7.0)
    assert decided(Response(503, retry_after="Thu, 01 Jan 1970 00:00:30 GMT")) == ("pending", 30.0)
    assert decided(Response(429, retry_after="3600")) == ("failed", 0.0)  # past the horizon
    assert decided(Response(500, retry_after="7"), rand=1.0) == ("pending", 5.0)
    assert decided(Response(429, retry_after="soon"), rand=1.0) == ("pending", 5.0)
    assert retry_after_s(None, 0.0) is None
