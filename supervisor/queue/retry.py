"""Retry delays: exponential with full jitter (AWS architecture blog's "full jitter")."""

from __future__ import annotations

import random


def retry_delay(
    attempt: int,
    *,
    base: float,
    cap: float,
    jitter: bool = True,
    rng: random.Random | None = None,
) -> float:
    """Seconds to wait after failed attempt `attempt` (1-based).

    min(cap, base * 2**(attempt-1)), then a uniform draw from [0, that] with jitter.
    `base == cap` with jitter off gives a fixed delay.
    """
    # The exponent is bounded so a huge attempt number cannot overflow a float.
    ceiling = float(min(cap, base * 2.0 ** min(max(0, attempt - 1), 64)))
    if not jitter:
        return ceiling
    return (rng or random).uniform(0.0, ceiling)
