"""The job state machine: JobState, the dead-letter statuses and the TRANSITIONS table.

Every write to the ledger (jobs.ledger) names one event of this table and takes its guard from
it: the UPDATE matches only rows in one of the event's from-states, so a write that the table
does not allow changes nothing. tests/jobs/core/test_states.py walks the table against the ledger.

    event            from                                   to
    enqueue          (new row)                              queued, or scheduled when delayed
    claim            queued, scheduled*, retrying*, running†  running
    renew            running (this run's attempt)           running
    progress         running                                running
    succeed          running (this run's attempt)           succeeded
    retry_later      running (this run's attempt)           retrying
    release          running                                queued
    lease_lapsed     running†                               queued
    give_up          queued, scheduled, retrying, running   dead  (+ a DeadLetter, one transaction)
    mark_published   queued, scheduled, retrying, running   (unchanged; published_at set)
    republish        queued, scheduled*, retrying*          (unchanged; published_at cleared)
    drop_early       scheduled, retrying                    (unchanged; published_at cleared)
    cancel           queued, scheduled, retrying            cancelled (never runs)
    request_cancel   running                                (unchanged; cancel_requested_at set)
    run_cancelled    running                                cancelled (its run stopped)
    replace          running (this run's attempt)           scheduled, never due, until taken over
    take_over        scheduled (a replaced row)             queued, or scheduled when delayed
    sleep            running (this run's attempt)           scheduled (durable sleep, no attempt)

    * once due (scheduled_for has come)   † only once its lease has lapsed
    A claim also sets published_at where it is unset: the message was delivered, whether or
    not the broker's confirm has marked the row yet (RabbitMQ marks after it).

A batch (jobs.flow.batches) has states of its own, in BATCH_TRANSITIONS; its writes are in
jobs.ledger.batch, each in the transaction of the member's write that causes it:

    event            from                     to
    batch_open       (new row)                running
    members_added    running                  (unchanged; total and pending grow)
    child_opened     running                  (unchanged; a child batch counts as pending)
    member_ended     running, complete        (unchanged; pending to succeeded/dead/cancelled)
    member_replayed  running, complete        (unchanged; a dead member's replay is pending)
    first_death      running, complete        (unchanged; died_at set once: on_death fires)
    batch_complete   running                  complete  (every member ended, not all succeeded)
    batch_succeed    running, complete        succeeded (every member and child succeeded)
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import models


class JobState(models.TextChoices):
    """Where a job is in its life."""

    QUEUED = "queued", "Queued"  # published (or waiting for the relay), not yet claimed
    SCHEDULED = "scheduled", "Scheduled"  # waits for `scheduled_for` (delay, eta or rate limit)
    RUNNING = "running", "Running"  # claimed by a worker under a lease
    RETRYING = "retrying", "Retrying"  # failed an attempt; the next one is scheduled
    SUCCEEDED = "succeeded", "Succeeded"  # finished; its return value is in `result`
    DEAD = "dead", "Dead"  # gave up; a DeadLetter row holds what is needed to replay it
    CANCELLED = "cancelled", "Cancelled"  # stopped on request: never ran, or its run stopped


class DeadLetterStatus(models.TextChoices):
    """What became of a job that gave up."""

    DEAD = "dead", "Dead"  # waiting for an operator
    REPLAYED = "replayed", "Replayed"  # sent again as a new job (see replayed_job)
    DISCARDED = "discarded", "Discarded"  # an operator decided not to run it


class BatchState(models.TextChoices):
    """Where a batch is: its members (and child batches) still running, or all ended."""

    RUNNING = "running", "Running"  # a member or a child batch has not ended yet
    COMPLETE = "complete", "Complete"  # all ended, some dead or cancelled (on_complete fired)
    SUCCEEDED = "succeeded", "Succeeded"  # every member and child succeeded (on_success fired)


ACTIVE_STATES = (JobState.QUEUED, JobState.SCHEDULED, JobState.RUNNING, JobState.RETRYING)
WAITING_STATES = (JobState.QUEUED, JobState.SCHEDULED, JobState.RETRYING)
CLAIMABLE_STATES = WAITING_STATES
FINISHED_STATES = (JobState.SUCCEEDED, JobState.DEAD, JobState.CANCELLED)
# Not a ledger state: what the status API shows for a succeeded job whose children have not
# all ended (BullMQ's name; jobs.models.Job.shown_state).
WAITING_CHILDREN = "waiting_children"


@dataclass(frozen=True)
class Transition:
    """One event of the state machine: the states it may start from and where it leads.

    `target` None means the event leaves the state as it is (it marks the row, e.g. published).
    """

    event: str
    sources: tuple[JobState, ...]
    target: JobState | None

    def allows(self, state: str) -> bool:
        return state in self.sources


def _table(*transitions: Transition) -> dict[str, Transition]:
    return {t.event: t for t in transitions}


TRANSITIONS: dict[str, Transition] = _table(
    Transition("claim", (*WAITING_STATES, JobState.RUNNING), JobState.RUNNING),
    Transition("renew", (JobState.RUNNING,), JobState.RUNNING),
    Transition("progress", (JobState.RUNNING,), JobState.RUNNING),
    Transition("succeed", (JobState.RUNNING,), JobState.SUCCEEDED),
    # DEFER_CLAIM (jobs.ledger.deferred): a run that read its waiting row writes its claim
    # late, or not at all when it succeeds first; a run that vanished unclaimed is recorded.
    Transition("claim_deferred", WAITING_STATES, JobState.RUNNING),
    Transition("succeed_unclaimed", WAITING_STATES, JobState.SUCCEEDED),
    Transition("run_lost", WAITING_STATES, JobState.RUNNING),
    Transition("retry_later", (JobState.RUNNING,), JobState.RETRYING),
    Transition("release", (JobState.RUNNING,), JobState.QUEUED),
    Transition("lease_lapsed", (JobState.RUNNING,), JobState.QUEUED),
    Transition("give_up", ACTIVE_STATES, JobState.DEAD),
    # A fast worker may claim a job before its publisher marks it: the mark still lands.
    Transition("mark_published", ACTIVE_STATES, None),
    Transition("republish", WAITING_STATES, None),
    Transition("drop_early", (JobState.SCHEDULED, JobState.RETRYING), None),
    Transition("cancel", WAITING_STATES, JobState.CANCELLED),
    Transition("request_cancel", (JobState.RUNNING,), None),
    Transition("run_cancelled", (JobState.RUNNING,), JobState.CANCELLED),
    # Celery's Task.replace(): the run hands its id to the signature replacing it; the row
    # waits (scheduled, never due) until that signature's task of the same id takes it over.
    Transition("replace", (JobState.RUNNING,), JobState.SCHEDULED),
    Transition("take_over", (JobState.SCHEDULED,), JobState.QUEUED),
    # A durable sleep (self.sleep()): the run ends, the row waits for its wake-up time.
    Transition("sleep", (JobState.RUNNING,), JobState.SCHEDULED),
)


def sources(event: str) -> tuple[JobState, ...]:
    """The from-states of `event`: the guard of the ledger write that carries it out."""
    return TRANSITIONS[event].sources


def target(event: str) -> JobState:
    """The state `event` leads to (for events that change the state)."""
    to = TRANSITIONS[event].target
    if to is None:
        raise ValueError(f"event {event!r} does not change a job's state")
    return to


@dataclass(frozen=True)
class BatchTransition:
    """One event of a batch's state machine (`target` None: the state stays, counters move)."""

    event: str
    sources: tuple[BatchState, ...]
    target: BatchState | None

    def allows(self, state: str) -> bool:
        return state in self.sources


_ENDING = (BatchState.RUNNING, BatchState.COMPLETE)  # a replayed member may end in a complete one

BATCH_TRANSITIONS: dict[str, BatchTransition] = {
    t.event: t
    for t in (
        BatchTransition("members_added", (BatchState.RUNNING,), None),
        BatchTransition("child_opened", (BatchState.RUNNING,), None),
        BatchTransition("member_ended", _ENDING, None),
        BatchTransition("member_replayed", _ENDING, None),
        BatchTransition("first_death", _ENDING, None),
        BatchTransition("batch_complete", (BatchState.RUNNING,), BatchState.COMPLETE),
        BatchTransition("batch_succeed", _ENDING, BatchState.SUCCEEDED),
    )
}


def batch_sources(event: str) -> tuple[BatchState, ...]:
    """The from-states of a batch `event`: the guard of its write in jobs.ledger.batch."""
    return BATCH_TRANSITIONS[event].sources
