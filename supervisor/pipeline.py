"""The worker loop's decisions, as pure functions of what its jobs are doing.

A worker holds up to `depth` claimed jobs (`[supervisor] pipeline`; DESIGN.md,
"Pipelined worker"), each at its own stage: one is derived at a time (the core is the
worker's) while the ones before it store their variants and commit, and the next one's
original is fetched. A claim batch (`[queue] claim_batch`) is the same loop at depth 1
holding a whole batch. Every job keeps its own token, lease, deadline and fence; these
functions decide how deep the loop is, when to claim, when a held job may start and
what a stop does to each stage. `derivd.worker_loop` runs them; the supervisor reads
the depth its worker reports (`derivd.processes.pipe`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


def worker_depth(
    pipeline: int, claim_batch: int, *, reads_original: bool, stores_objects: bool
) -> int:
    """How many jobs a worker has at different stages at once: `[supervisor] pipeline`,
    or 1

    - with `[queue] claim_batch` above 1: a batch of short jobs already shares its round
      trips; a pipeline would only hold its rows longer;
    - for a backend that neither reads an original nor stores a variant (`noop`): a
      pipeline overlaps a job's store round trips with the next one's derive; with no
      round trip there is nothing to overlap, and a second job held would only keep its
      row claimed longer and double the worker's transactions in flight (+25 % server
      CPU per noop job when it did: bench/RESULTS.md)."""
    if claim_batch > 1 or not (reads_original or stores_objects):
        return 1
    return pipeline


def capacity(depth: int, claim_batch: int) -> int:
    """How many jobs the loop holds at most: its depth, or a whole claim batch (a batch
    runs at depth 1)."""
    return depth + claim_batch - 1


class Stage(StrEnum):
    HELD = "held"  # claimed, not started; its original's GET may be in flight
    DERIVING = "deriving"  # started: the worker's one derive, its original in
    STORING = "storing"  # write-ahead, then its variants' PUTs
    COMMITTING = "committing"  # its fenced commit is sent (and may carry the next claim)


def claim_room(
    stages: Sequence[Stage],
    *,
    limit: int,
    batch: int = 1,
    claiming: int,
    stopping: bool,
    replaced: int = 0,
    leaving: int = 0,
    jobs_left: int | None = None,
) -> int:
    """How many jobs to claim now. `stages`: the jobs held, committing ones included;
    `limit`: how many the loop may hold (`capacity`). `claiming`: jobs asked for by
    claims not yet answered; `replaced`: committing jobs whose commit carries one of
    those claims (each leaves before what its claim takes arrives: the loop reports an
    outcome before it admits the next job). So the loop will hold len(stages) -
    replaced + claiming jobs, never more than `limit` at any moment, as its supervisor
    counts them. `jobs_left`: how many jobs the worker may still start
    (max_jobs_per_worker; None: no limit).

    A claim that rides on a commit sent anyway (derivd_commit_and_claim) has `leaving`
    jobs: the committing ones it goes with, among `stages`. It takes their places and
    any free one. In the steady state every claim is such a one, and a job costs the
    database one statement.

    A claim of its own (a round trip and a transaction of its own) takes up to `batch`
    jobs, and only when no claim is on its way, no commit is about to carry it (a job
    committing) and no job is held unstarted (claimed earlier, it would wait with its
    lease running): a derive starts, or a job's PUTs, and the next job's GET overlaps
    them."""
    held_then = len(stages) - replaced - leaving + claiming
    room = limit - held_then
    if jobs_left is not None:
        room = min(room, jobs_left - len(stages) - claiming)
    if stopping or room < 1:
        return 0
    if leaving:
        return room
    if claiming or Stage.HELD in stages or Stage.COMMITTING in stages:
        return 0
    return min(room, batch)


class OnStop(StrEnum):
    RELEASE = "release"  # give it back now: no attempt burned, nothing of it stored
    DRAIN = "drain"  # let it finish (its derive cannot be interrupted; its PUTs are out)


def on_stop(stage: Stage) -> OnStop:
    """What a graceful stop does to a job at `stage`: a held job (never started) goes
    back at once, unburned; a started one finishes within shutdown_grace (past it the
    supervisor kills the worker and releases what is left, fenced)."""
    return OnStop.RELEASE if stage is Stage.HELD else OnStop.DRAIN


# The share of a lease a held job keeps unspent when it starts: the supervisor's kill of
# the job ahead of it (job_timeout, then kill_grace) and its release of the held job fit
# in it, however late the held job started.
LEASE_MARGIN = 0.1


@dataclass(frozen=True)
class StartTerms:
    """What decides whether a held job may still start: [queue] lease and renew,
    [supervisor] job_timeout and kill_grace."""

    lease_s: float
    job_timeout: float
    kill_grace: float
    renew: bool


def latest_start(claimed_at: float, terms: StartTerms) -> float:
    """The last moment a job claimed at `claimed_at` (sent then) may start: its lease
    still covers a whole job (job_timeout + kill_grace) and the margin. With renew the
    supervisor's heartbeat keeps every held lease ahead of the job."""
    if terms.renew:
        return float("inf")
    whole_job = terms.job_timeout + terms.kill_grace
    return claimed_at + terms.lease_s * (1 - LEASE_MARGIN) - whole_job


def may_start(now: float, *, claimed_at: float, waited: bool, terms: StartTerms) -> bool:
    """Whether a held job starts now, or goes back unburned (released: its wait behind
    another job never costs it its lease or an attempt). `waited`: it was claimed behind
    another job still to be derived (a pipeline's next job, a batch's second); one that
    did not wait always starts, so a lease shorter than a job (which the config check
    refuses) can never turn into claim-release forever.

    Why this holds: jobs start in claim order; as one starts (and while it waits for its
    original) every job held behind it that is past its own latest start goes back; the
    job that starts ends its derive within job_timeout (or the supervisor kills it and
    releases the ones held). So a held job's turn comes while its lease still holds,
    with kill_grace and the margin to spare: it starts or goes back fenced."""
    return not waited or now <= latest_start(claimed_at, terms)


def defer_commit(
    *, inline: bool, next_held: bool, oldest_age_s: float, flush_after_s: float
) -> bool:
    """Whether a stored job's commit waits to share a round trip with the next one's: only
    in a loop that stores on its deriving thread (`inline`, depth 1), while another held
    job can be derived at once (a batch's next one) and the oldest commit waiting is
    younger than `flush_after_s`."""
    return inline and next_held and oldest_age_s < flush_after_s
