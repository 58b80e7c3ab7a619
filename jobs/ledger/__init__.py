"""Every write to the job ledger, each named for its event and guarded by jobs.core.states.

A write matches only rows in one of its event's from-states (``sources(event)``), and a
worker's writes are also fenced by the attempt number of the run holding the claim: a run
that lost its claim changes nothing. No Celery, no Redis here: publishing is the caller's.
"""

from jobs.ledger.accept import (
    insert,
    insert_holding_key,
    lapsed_lease_dead,
    lapsed_leases_requeued,
    mark_published,
    republish,
    unpublish,
    waiting_but_due,
)
from jobs.ledger.alongside import check as check_alongside
from jobs.ledger.bulk import BULK_BATCH, NewRow, insert_many
from jobs.ledger.busy import busy_released, database_busy, when_free
from jobs.ledger.cancel import (
    cancel_discarded,
    cancel_waiting,
    children_cancelled,
    request_cancel,
    run_cancelled,
)
from jobs.ledger.claim import EARLY_TOLERANCE, Claim, Dropped, claim, claim_delivery
from jobs.ledger.deferred import (
    Peeked,
    Success,
    claim_deferred,
    peek,
    run_lost,
    succeed_unclaimed,
    succeed_unclaimed_many,
    unread,
)
from jobs.ledger.replace import REPLACED, replace, replaced_by_untracked, take_over
from jobs.ledger.resolve import (
    DeadToReplay,
    Replayed,
    dead_letter_replayed,
    dead_letters_discarded,
    dead_letters_replayed,
    dead_letters_to_replay,
)
from jobs.ledger.rows import new_job
from jobs.ledger.run import (
    MAX_FAILURES_KEPT,
    Defaults,
    describe_exception,
    give_up,
    progress,
    release,
    renew,
    retry_later,
    succeed,
)
from jobs.ledger.steps import (
    signal_sent,
    sleep,
    sleep_ended,
    step_failed,
    step_started,
    step_succeeded,
    steps_copied,
)

__all__ = [
    "BULK_BATCH",
    "EARLY_TOLERANCE",
    "MAX_FAILURES_KEPT",
    "REPLACED",
    "Claim",
    "DeadToReplay",
    "Defaults",
    "Dropped",
    "NewRow",
    "Peeked",
    "Replayed",
    "Success",
    "busy_released",
    "cancel_discarded",
    "cancel_waiting",
    "check_alongside",
    "children_cancelled",
    "claim",
    "claim_deferred",
    "claim_delivery",
    "database_busy",
    "dead_letter_replayed",
    "dead_letters_discarded",
    "dead_letters_replayed",
    "dead_letters_to_replay",
    "describe_exception",
    "give_up",
    "insert",
    "insert_holding_key",
    "insert_many",
    "lapsed_lease_dead",
    "lapsed_leases_requeued",
    "mark_published",
    "new_job",
    "peek",
    "progress",
    "release",
    "renew",
    "replace",
    "replaced_by_untracked",
    "republish",
    "request_cancel",
    "retry_later",
    "run_cancelled",
    "run_lost",
    "signal_sent",
    "sleep",
    "sleep_ended",
    "step_failed",
    "step_started",
    "step_succeeded",
    "steps_copied",
    "succeed",
    "succeed_unclaimed",
    "succeed_unclaimed_many",
    "take_over",
    "unpublish",
    "unread",
    "waiting_but_due",
    "when_free",
]
