"""The one masker for secrets: `config show`, every log line and every error message.

Two layers, both here:
- known values: the DSN's password and the credentials in the environment are registered
  once (`register_secret`) and replaced wherever they appear, in the spellings they take
  in a conninfo string or a URL (quoted, backslash-escaped, percent-encoded);
- shapes: `password=` (and `sslpassword=`) values in conninfo strings, with libpq's
  quoting (`'a b \\' c'`); the password of a URL's user info; `password=` in a query
  string; the signature and credential parameters of presigned S3 URLs; AWS secret keys
  spelled as `aws_secret_access_key=`.

When in doubt it masks more: a quoted value that never closes is masked to the end, and
an unquoted one to the next white space (or, in a URL query, to the next `&key=`).
"""

from __future__ import annotations

import re
from urllib.parse import quote, quote_plus

MASK = "***"
# The environment variables whose values are secrets (registered by setup_logging).
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "PGPASSWORD")
# Shorter values would mask ordinary words; real secrets are far longer.
MIN_SECRET = 6

_SECRETS: set[str] = set()

# A libpq value: single-quoted with backslash escapes (masked to the end if it never
# closes), or unquoted up to white space (a backslash escapes the next character).
_VALUE = r"(?:'(?:[^'\\]|\\.)*(?:'|\\?$)|(?:[^\s\\]|\\.)+)"
# A key that ends in password (sslpassword, db_password...) or names an AWS secret; not
# after `?` or `&`, where _PASSWORD_QUERY has masked it already.
_PASSWORD_KV = re.compile(
    r"(?<![?&\w])(\w*(?:password|secret_access_key|secret_?key|session_?token)\s*=\s*)" + _VALUE,
    re.IGNORECASE | re.DOTALL,
)
# In a URL query the value ends at the next `&key=` (an `&` inside a value stays masked).
_PASSWORD_QUERY = re.compile(r"([?&](?:ssl)?password=)(?:(?!&[A-Za-z_]+=)[^\s#])*", re.IGNORECASE)
# user:password@ in a URL, up to the LAST `@` of the token: a raw `@` in the password
# must not leave its tail behind.
_PASSWORD_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*:)\S*(@)")
_PRESIGNED = re.compile(
    r"((?:X-Amz-(?:Signature|Credential|Security-Token)|Signature|AWSAccessKeyId)=)[^&\s\"']+",
    re.IGNORECASE,
)


def register_secret(value: str | None) -> None:
    """Never show `value` again in this process (it survives fork and a new setup)."""
    if value and len(value) >= MIN_SECRET:
        _SECRETS.update(_spellings(value))


def _spellings(value: str) -> set[str]:
    """How a secret can appear: as is, libpq-escaped, percent-encoded, and (when it has
    white space) the long words of it, which a parser may quote one at a time."""
    escaped = value.replace("\\", "\\\\").replace("'", "\\'")
    found = {value, escaped, quote(value, safe=""), quote(value), quote_plus(value)}
    found.update(part for part in value.split() if len(part) >= MIN_SECRET)
    return found


def parse_dsn(dsn: str) -> dict[str, str] | None:
    """libpq's reading of a conninfo string or URL; None when libpq cannot parse it."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        return {k: str(v) for k, v in conninfo_to_dict(dsn).items() if v is not None}
    except Exception:  # psycopg.ProgrammingError; its text may quote the DSN: not kept
        return None


def dsn_password(dsn: str) -> str | None:
    """The password of a conninfo string or URL, if it has one (None when malformed)."""
    params = parse_dsn(dsn) if dsn else None
    return (params or {}).get("password") or None


def mask_dsn(dsn: str) -> str:
    """The DSN with its password hidden, for `config show` and the log. A string libpq
    cannot parse is hidden whole: where its password ends is anybody's guess."""
    params = parse_dsn(dsn)
    if params is None:
        return MASK
    masked = _mask_shapes(dsn)
    for secret in sorted(_spellings(params.get("password", "")), key=len, reverse=True):
        if secret:
            masked = masked.replace(secret, MASK)
    return masked


# A URL's user info: everything between `scheme://` and the LAST `@` before the host's end.
_URL_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/?#]*@")


def mask_url(url: str) -> str:
    """A URL (an S3 endpoint) with its user info hidden whole: `user:password@` may hold
    an access key and its secret, and a user name alone may be either."""
    return _URL_USERINFO.sub(r"\1" + MASK + "@", url.strip())


def shown_url(url: str) -> str:
    """A webhook URL as derivd shows it anywhere (`webhooks list`, `config show`): without
    its query, which may carry a token of the receiver's (`?token=…`)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    return urlunsplit((*parts[:3], "…" if parts.query else "", ""))


def url_secrets(url: str) -> list[str]:
    """The user name and password of a URL, to register: a library's error may echo
    them in some other spelling than the URL's."""
    from urllib.parse import unquote, urlsplit

    try:
        parts = urlsplit(url.strip())
    except ValueError:
        return []
    found = [parts.username, parts.password]
    return [piece for value in found if value for piece in (value, unquote(value))]


def redact(text: str) -> str:
    """`text` without any registered secret or secret-shaped value."""
    for secret in sorted(_SECRETS, key=len, reverse=True):  # longest first: no tails left
        if secret in text:
            text = text.replace(secret, MASK)
    return _mask_shapes(text)


def _mask_shapes(text: str) -> str:
    text = _PRESIGNED.sub(r"\1" + MASK, text)
    text = _PASSWORD_QUERY.sub(r"\1" + MASK, text)
    text = _PASSWORD_URL.sub(r"\1" + MASK + r"\2", text)
    return _PASSWORD_KV.sub(r"\1" + MASK, text)


def one_line(error: BaseException) -> str:
    """The first line of an error (a driver's, a library's), secrets masked: enough to
    act on, no dumps."""
    text = str(error).strip().splitlines()
    return redact(text[0]) if text else type(error).__name__
