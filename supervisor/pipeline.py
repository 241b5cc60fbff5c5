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


def worker_depth(configured: int, *, reads_original: bool, stores_objects: bool) -> int:
    """How many jobs a worker holds at once: `configured` (Config.pipeline_depth), or 1
    for a backend that neither reads an original nor stores a variant (`noop`). A
    pipeline overlaps a job's store round trips with the next one's derive; with no
    round trip there is nothing to overlap, and a second job held would only keep its
    row claimed longer and double the worker's transactions in flight (+25 % server CPU
    per noop job: bench/RESULTS.md, "Sitting of 2026-12-03")."""
    return configured if reads_original or stores_objects else 1


class Stage(StrEnum):
    FETCHING = "fetching"  # claimed; its original's GET is in flight or done
    DERIVING = "deriving"  # the worker's one derive
    STORING = "storing"  # write-ahead, then its variants' PUTs
    COMMITTING = "committing"  # its fenced commit is sent (and may carry the next claim)


def claim_room(
    stages: Sequence[Stage],
    *,
    depth: int,
    claiming: int,
    stopping: bool,
    replaced: int = 0,
    jobs_left: int | None = None,
    folded: bool = False,
) -> int:
    """How many jobs to claim now. `stages`: the jobs held, committing ones included.
    `claiming`: jobs asked for by claims not yet answered; `replaced`: committing jobs
    whose commit carries one of those claims (each leaves before what its claim takes
    arrives: the worker reports an outcome before it admits the next job). So the
    pipeline will hold len(stages) - replaced + claiming jobs, never more than `depth`
    at any moment, as its supervisor counts them. `jobs_left`: how many jobs the worker
    may still start (max_jobs_per_worker; None: no limit).

    A `folded` claim rides on a commit that is sent anyway (derivd_commit_and_claim), its
    own committing job among `stages`: it takes that job's place and any free one. In
    the steady state every claim is such a one, and a job costs the database one
    statement, as with a one-job worker.

    A claim of its own (a round trip and a transaction of its own) takes one job, and
    only when no claim is on its way, no commit is about to carry it (a job committing;
    one whose PUTs are out may take long) and no job waits for its derive (claimed
    earlier, it would wait with its lease running): a derive starts, or a job's PUTs,
    and the next job's GET overlaps them."""
    held_then = len(stages) - replaced + claiming
    room = depth - held_then + (1 if folded else 0)
    if jobs_left is not None:
        room = min(room, jobs_left - len(stages) - claiming)
    if stopping or room < 1:
        return 0
    if folded:
        return room
    if claiming or Stage.FETCHING in stages or Stage.COMMITTING in stages:
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
