"""Events sent to a job: ``jobs.signal(job_id, "approved", {"by": 7})`` delivers to the job's
``self.wait_for("approved")`` (jobs.worker.steps), now if it is parked there, or when it gets
there. Once per job and name: a second signal of the name is refused (SignalRefused)."""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction

from jobs import ledger
from jobs.core.conf import backlot_settings
from jobs.core.exceptions import InvalidPayload, SignalRefused
from jobs.core.payload import payload_check
from jobs.enqueue.publish import publish_job
from jobs.models import Job
from jobs.worker.registry import task_by_name
from jobs.worker.steps import wait_step

logger = logging.getLogger(__name__)


def signal(job_id: Any, name: str, payload: Any = None) -> bool:
    """Send the event `name` (with a small JSON `payload`) to a job; True when it woke the job
    (parked in its wait), False when it is kept for the job's wait to come. Raises
    Job.DoesNotExist for an unknown job, SignalRefused for a finished one or a second signal
    of the same name, InvalidPayload for a payload that is not small JSON."""
    if not name or len(name) > 190:
        raise InvalidPayload("an event's name must be 1-190 characters")
    payload_check(
        task_name=f"signal {name!r}",
        args=[payload],
        kwargs={},
        max_bytes=backlot_settings().MAX_PAYLOAD_BYTES,
    )
    job_id = str(job_id)
    with transaction.atomic():
        outcome = ledger.signal_sent(
            job_id=job_id, name=name, payload=payload, step=wait_step(name)
        )
        if outcome == "missing":
            raise Job.DoesNotExist(f"No job {job_id}")
        if outcome == "finished":
            raise SignalRefused(f"Job {job_id} has finished; signal {name!r} refused")
        if outcome == "duplicate":
            raise SignalRefused(f"Job {job_id} already got signal {name!r}; the first one wins")
        if outcome == "woke":
            transaction.on_commit(lambda: _wake(job_id))
    logger.info("Job %s: signal %s %s", job_id, name, outcome)
    return outcome == "woke"


def _wake(job_id: str) -> None:
    """Send the woken job's message now; the relay sends it if the broker is away."""
    job = Job.objects.filter(id=job_id).first()
    if job is None:
        return
    if not publish_job(job=job, task=task_by_name(job.task_name)):
        logger.warning("Job %s: woken; the broker is away, the relay sends it", job_id)
