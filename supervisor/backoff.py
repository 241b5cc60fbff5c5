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
    ceiling = float(min(cap, base * 2.0 ** max(0, attempt - 1)))
    if not jitter:
        return ceiling
    return (rng or random).uniform(0.0, ceiling)
