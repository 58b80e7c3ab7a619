"""Admin for the job ledger (read-only history) and dead letters (inspect, replay, discard).

Replay and discard need their own permissions; a forged POST without them gets 403. Every
action is recorded as an AuditEntry. Arguments are shown masked unless the viewer may see
raw arguments.
"""

from jobs.admin.base import EstimatedCountPaginator, ReadOnlyAdmin
from jobs.admin.batches import BatchAdmin
from jobs.admin.deadletters import AuditEntryAdmin, DeadLetterAdmin
from jobs.admin.jobs import JobAdmin

__all__ = [
    "AuditEntryAdmin",
    "BatchAdmin",
    "DeadLetterAdmin",
    "EstimatedCountPaginator",
    "JobAdmin",
    "ReadOnlyAdmin",
]
