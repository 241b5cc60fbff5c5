"""A pipelined worker's decisions, as pure functions of what its jobs are doing.

A worker with `[supervisor] pipeline` = N holds up to N claimed jobs, each at its own
stage (DESIGN.md, "Pipelined worker"): one fetches its original and is derived (derives
run one at a time: the core is the worker's), while the previous ones store their
variants and commit. Every job keeps its own token, lease, deadline and fence; these
functions decide when to claim and what a stop does to each stage. `derivd.pipelined`
runs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum


class Stage(StrEnum):
    FETCHING = "fetching"  # claimed; its original's GET is in flight or done
    DERIVING = "deriving"  # the worker's one derive
    STORING = "storing"  # write-ahead, its variants' PUTs, then its fenced commit


def claim_room(
    stages: Sequence[Stage],
    *,
    depth: int,
    claiming: int,
    stopping: bool,
    jobs_left: int | None = None,
) -> int:
    """How many jobs to claim now (0 or 1). A job is claimed only when the pipeline has
    room for it and no other job is waiting to be derived: claimed earlier, it would wait
    for a derive with its lease running (claims as late as the pipeline allows), claimed
    later, its GET would not overlap the derive before it. `jobs_left`: how many jobs the
    worker may still start (max_jobs_per_worker; None: no limit)."""
    if stopping or claiming:
        return 0
    if Stage.FETCHING in stages or len(stages) >= depth:
        return 0
    if jobs_left is not None and jobs_left <= len(stages):
        return 0
    return 1


class OnStop(StrEnum):
    RELEASE = "release"  # give it back now: no attempt burned, nothing of it stored
    DRAIN = "drain"  # let it finish (its derive cannot be interrupted; its PUTs are out)


def on_stop(stage: Stage, *, prefetched: bool) -> OnStop:
    """What a graceful stop does to a job at `stage`. `prefetched`: it was claimed while
    another job was in the pipeline (a one-job worker would not hold it yet). Such a job
    goes back at once unless its derive has begun; every other job finishes within
    shutdown_grace, as a one-job worker's job does (past it the supervisor kills the
    worker and releases what is left, fenced)."""
    if stage is Stage.FETCHING and prefetched:
        return OnStop.RELEASE
    return OnStop.DRAIN
