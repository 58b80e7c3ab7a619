"""The job ledger, idempotency keys, recorded effects and dead letters."""

from jobs.core.states import (
    ACTIVE_STATES,
    CLAIMABLE_STATES,
    FINISHED_STATES,
    WAITING_STATES,
    BatchState,
    DeadLetterStatus,
    JobState,
)
from jobs.models.active import ActiveJob, ActiveJobQuerySet
from jobs.models.batch import CALLBACK_KINDS, Batch, BatchQuerySet
from jobs.models.deadletter import DEAD_LETTER_FILTERS, AuditEntry, DeadLetter, DeadLetterQuerySet
from jobs.models.job import Job, JobQuerySet
from jobs.models.once import Effect, IdempotencyRecord
from jobs.models.schedule import ScheduleFire, ScheduleFireQuerySet
from jobs.models.step import JobSignal, JobStep, StepQuerySet, StepState

__all__ = [
    "ACTIVE_STATES",
    "CALLBACK_KINDS",
    "CLAIMABLE_STATES",
    "DEAD_LETTER_FILTERS",
    "FINISHED_STATES",
    "WAITING_STATES",
    "ActiveJob",
    "ActiveJobQuerySet",
    "AuditEntry",
    "Batch",
    "BatchQuerySet",
    "BatchState",
    "DeadLetter",
    "DeadLetterQuerySet",
    "DeadLetterStatus",
    "Effect",
    "IdempotencyRecord",
    "Job",
    "JobQuerySet",
    "JobSignal",
    "JobState",
    "JobStep",
    "ScheduleFire",
    "ScheduleFireQuerySet",
    "StepQuerySet",
    "StepState",
]
