"""The rules an original's analysis must meet before the fenced commit stores it.

They are the CHECK `archive_files_original_check` of sql/schema.sql, said again in Python so
that a handler's malformed analysis fails its own job (`processing_failed`, one log line)
instead of the commit statement that carries a whole batch; tests/test_analysis_stored.py holds
the two to the same answers.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

from derivd.handlers.base import Analysis

COLOUR = re.compile(r"#[0-9a-fA-F]{6}")  # stored in lower case (normalised)
FORMAT = re.compile(r"[a-z0-9]{1,16}")
# ThumbHash is 17-25 bytes (24-36 base64 characters); padding optional.
PLACEHOLDER = re.compile(r"[A-Za-z0-9+/]{16,64}={0,2}")
DHASH_MIN, DHASH_MAX = -(2**63), 2**63 - 1


def normalised(analysis: Analysis) -> Analysis:
    """The analysis as stored (once `problem` found none): the colour in lower case."""
    return replace(analysis, colour=analysis.colour.lower())


def problem(analysis: Analysis) -> str | None:
    """What makes `analysis` unstorable (one line naming the field), or None."""
    a = analysis
    if not all(_is_int(v) for v in (a.width, a.height, a.frames)):
        return "width, height and frames must be integers"
    if min(a.width, a.height, a.frames) < 1:
        return f"width, height and frames must be positive ({a.width}x{a.height}, {a.frames})"
    if not isinstance(a.has_alpha, bool):
        return "has_alpha must be a bool"
    for name, pattern in (("format", FORMAT), ("colour", COLOUR), ("placeholder", PLACEHOLDER)):
        value = getattr(a, name)
        if not isinstance(value, str) or not pattern.fullmatch(value):
            return f"{name} {str(value)[:80]!r} does not match {pattern.pattern}"
    if not _is_int(a.dhash):
        return "dhash must be an integer"
    if not DHASH_MIN <= a.dhash <= DHASH_MAX:
        return "dhash must be a signed 64-bit integer"
    return _media_problem(a.media)


def _media_problem(media: object) -> str | None:
    """`media` (a preview's facts) is None or a JSON object: the commit sends it as JSON."""
    if media is None:
        return None
    if not isinstance(media, dict):
        return "media must be a JSON object or None"
    try:
        json.dumps(media, allow_nan=False)
    except (TypeError, ValueError) as error:
        return f"media is not JSON: {str(error)[:80]}"
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
