"""The job events: documented Django signals, sent by the platform at each step of a job.

Connect a receiver the way Django's own signals are connected:

    from jobs import events

    @receiver(events.job_dead)
    def page_someone(sender, *, job_id, task, queue, attempt, exception, **kwargs): ...

Every signal is sent with ``sender`` = the task's name (a str) and the keyword arguments listed
below; receivers must accept ``**kwargs`` (later versions add arguments). They run in the
process that made the change (the web process for enqueued/replayed, the worker for the rest),
after the ledger write that the event reports has been made, but for one case: job_succeeded of
a short run whose success the worker writes together with others' (DEFER_CLAIM and
SUCCESS_BATCH > 1, the defaults; jobs.worker.finishes) is sent as the run ends, in the process
that ran it, before that write: until the write the job reads running (its run record in
Redis; the row was never claimed), then succeeded, within BACKLOT['SUCCESS_BATCH_SECONDS']
(0.02 s by default) while the database answers; a cancel or another run that changed the row
in that window keeps it (the write is refused, and counted so). A receiver that raises is logged
(``jobs.core.events`` logger, with its traceback) and never breaks the job or the caller; the other
receivers still run. Backlot's own structured log lines and Redis metrics are receivers of
these signals (jobs.worker.telemetry).
"""

from __future__ import annotations

import logging
from typing import Any

from django.dispatch import Signal

logger = logging.getLogger(__name__)

job_enqueued = Signal()
"""A job was accepted (its ledger row written, or an untracked job handed to the broker).
Arguments: job_id, task, queue, priority, scheduled_for (datetime or None), owner_id.
Sent after the caller's transaction commits (or at once outside one)."""

job_started = Signal()
"""A worker claimed the job and its code is about to run. Arguments: job_id, task, queue,
attempt."""

job_retrying = Signal()
"""An attempt failed and the retry policy scheduled another. Arguments: job_id, task, queue,
attempt, duration (seconds the attempt ran, or None), exception, delay (seconds until the next
attempt)."""

job_succeeded = Signal()
"""The job's run returned: its ledger row is succeeded (a short run's written with others:
succeeded within SUCCESS_BATCH_SECONDS, see above). Arguments: job_id, task, queue, attempt,
duration, result."""

job_dead = Signal()
"""The job gave up: its ledger row is dead and its dead letter written (one transaction).
Arguments: job_id, task, queue, attempt, duration (or None), exception, dead_letter_id."""

job_cancelled = Signal()
"""The job was cancelled: its ledger row is cancelled (no retry, no dead letter).
Arguments: job_id, task, queue, attempt, while_running (its run was stopped, or it never ran),
by (the user who cancelled, when known; sent in that user's process), duration (while_running)."""

job_rate_limited = Signal()
"""A job found no rate-limit token and was re-sent for its turn (no attempt spent).
Arguments: job_id, wait (seconds until its turn)."""

job_replayed = Signal()
"""Dead letters were replayed as new jobs. Arguments: job_ids (the new jobs' ids),
dead_letter_ids, by (the operator, or None)."""

# Step events (jobs.worker.steps): each step of self.step() a run reaches, in the worker, after
# the step's ledger write. Durable sleeps and waits are not steps here: a parked job shows on
# the dashboard and in backlot_queue_parked. A run that lost its claim has its step writes
# refused and sends no step_finished for them.
step_started = Signal()
"""A step's function is about to run (its row is running, one more attempt). Arguments:
job_id, name, position (0 for the job's first step), attempt (the job's)."""

step_finished = Signal()
"""A step ended. Arguments: job_id, name, position, attempt, outcome, seconds, exception.
outcome "succeeded" (its result stored) or "failed" (it raised `exception`; the job's retry
policy decides the rest), both after a step_started, `seconds` the function's run time; or
"skipped": a later run of the job got the stored result back without running it (no
step_started before it, seconds 0.0). `exception` is None unless failed."""

# Batch events (jobs.flow.batches) are sent with this sender (and `task`), after the transaction
# that made the change commits; each names the batch by `batch_id`.
BATCH_SENDER = "jobs.batch"

batch_opened = Signal()
"""A batch was opened and its first members accepted. Arguments: batch_id, description,
owner_id, parent_id (the batch it was opened in, or None), total (members so far)."""

batch_death = Signal()
"""A member of the batch was dead-lettered for the first time (sent once per batch).
Arguments: batch_id, job_id (the dead member), callback_job_id (the on_death job, or None)."""

batch_completed = Signal()
"""Every member of the batch (and every child batch) has ended: succeeded, dead or cancelled
(sent once per batch). Arguments: batch_id, total, succeeded, dead, cancelled,
callback_job_id (the on_complete job, or None)."""

batch_succeeded = Signal()
"""Every member of the batch (and every child batch) has succeeded (sent once per batch; after
batch_completed, possibly much later: when a dead member's replay succeeds). Arguments:
batch_id, total, succeeded, dead, cancelled, callback_job_id (the on_success job, or None)."""

ALL = {
    "enqueued": job_enqueued,
    "started": job_started,
    "retrying": job_retrying,
    "succeeded": job_succeeded,
    "dead": job_dead,
    "cancelled": job_cancelled,
    "rate_limited": job_rate_limited,
    "replayed": job_replayed,
    "step_started": step_started,
    "step_finished": step_finished,
    "batch_opened": batch_opened,
    "batch_death": batch_death,
    "batch_completed": batch_completed,
    "batch_succeeded": batch_succeeded,
}


def send(signal: Signal, *, task: str, **arguments: Any) -> None:
    """Send `signal` to every receiver; one that raises is logged and the others still run."""
    if not signal.has_listeners(task):
        return
    for receiver, outcome in signal.send_robust(sender=task, task=task, **arguments):
        if isinstance(outcome, Exception):
            logger.error(
                "Receiver %r of a job event failed (job %s)",
                receiver,
                arguments.get("job_id", arguments.get("job_ids")),
                exc_info=(type(outcome), outcome, outcome.__traceback__),
            )
