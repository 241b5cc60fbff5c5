"""What an attempt's response means for its delivery: pure decisions, tested directly.

2xx: delivered. 410: the endpoint wants no more of it: failed at once. 429 and 503 with
Retry-After: retried then (when that is within the horizon). Anything else (another
status, a redirect, a timeout, a reset, a TLS failure): retried with exponential backoff
and full jitter, base `retry_base`, doubling, capped at an hour, until the horizon: past
it, failed.
"""

from __future__ import annotations

import email.utils
import random
from collections.abc import Callable
from dataclasses import dataclass

BACKOFF_CAP_S = 3600.0
HONOURED = (429, 503)  # statuses whose Retry-After is taken


@dataclass(frozen=True)
class Response:
    """What one POST came to: a status (None: no response) and a safe one-line error."""

    status: int | None
    error: str | None = None
    retry_after: str | None = None


@dataclass(frozen=True)
class Decision:
    status: str  # delivered, failed, pending (again)
    delay_s: float = 0.0


def backoff(attempt: int, base: float, rand: Callable[[], float] = random.random) -> float:
    """Full jitter: a random 0..min(cap, base * 2^(attempt-1))."""
    ceiling = min(BACKOFF_CAP_S, base * 2.0 ** min(max(attempt - 1, 0), 30))
    return rand() * ceiling


def retry_after_s(value: str | None, now: float) -> float | None:
    """Retry-After as seconds from now (delta-seconds or an HTTP date); None: absent or
    unreadable."""
    if not value:
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - now)


def error_text(response: Response) -> str | None:
    if response.status is None:
        return response.error or "no response"
    return None if 200 <= response.status < 300 else f"http {response.status}"


def decide(
    response: Response,
    *,
    attempt: int,
    age_s: float,
    horizon_s: float,
    base_s: float,
    now: float,
    rand: Callable[[], float] = random.random,
) -> Decision:
    status = response.status
    if status is not None and 200 <= status < 300:
        return Decision("delivered")
    if status == 410:
        return Decision("failed")
    delay = None
    if status in HONOURED:
        delay = retry_after_s(response.retry_after, now)
    if delay is None:
        delay = backoff(attempt, base_s, rand)
    if age_s + delay > horizon_s:
        return Decision("failed")
    return Decision("pending", delay)
