"""Failed attempts: the retry delay (exponential with full jitter, the AWS architecture
blog's "full jitter") and the one function that records a fenced failure with it. The
worker (a job raised) and the supervisor (a job timed out) both go through
`record_failure`."""

from __future__ import annotations

import random

from derivd.config import QueueSettings
from derivd.errors import ErrorCode
from derivd.queue.db import Job, QueueDB


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


def delay_after(job: Job, settings: QueueSettings, rng: random.Random | None = None) -> float:
    """The retry delay after `job`'s failed attempt, under the [queue] settings."""
    return retry_delay(
        job.attempt,
        base=settings.retry_base,
        cap=settings.retry_max,
        jitter=settings.retry_jitter,
        rng=rng,
    )


def record_failure(
    queue: QueueDB,
    job: Job,
    settings: QueueSettings,
    *,
    retry: bool,
    code: ErrorCode,
    rng: random.Random | None = None,
    extra_event: str | None = None,
) -> str | None:
    """Fail `job`'s attempt, fenced on its token: back to `queued` after the retry delay
    while attempts remain (`retry`), else `rejected` with `code`. Returns the row's new
    status, or None when the lease was lost (a `lease_lost` event is recorded then).
    Raises DatabaseUnavailable; the row then stays `processing` until its lease expires."""
    delay = delay_after(job, settings, rng)
    return queue.fail(
        job,
        retry=retry,
        code=code,
        max_attempts=settings.max_attempts,
        delay_s=delay,
        extra_event=extra_event,
    )
