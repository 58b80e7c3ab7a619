"""A run that ends in a durable sleep (jobs.worker.steps.Parked): the row is scheduled for the
wake-up in a write fenced by the run's claim, and the wake-up's message is handed to the broker
as a countdown when it is near (as a retry's is), else left to the relay, which publishes due
rows. The time lives in the ledger: a worker restart or a Redis flush loses no sleep (the
relay's missing-message re-send covers a countdown the broker lost)."""

from __future__ import annotations

import logging

from django.utils import timezone

from jobs import ledger
from jobs.broker import broker, counters
from jobs.worker import outcomes
from jobs.worker.lease import refused
from jobs.worker.redelivery import Runnable, resend
from jobs.worker.steps import Parked

logger = logging.getLogger(__name__)


def parked(
    task: Runnable, args: tuple, kwargs: dict, attempt: int, sleep: Parked, run_seconds: float
) -> None:
    """Record the sleep and publish the wake-up (when the broker should hold it)."""
    counters.flush()  # the run's step counts (jobs.worker.telemetry): a park sends no outcome
    job_id = outcomes.job_id_of(task)
    delay = (sleep.wake_at - timezone.now()).total_seconds()
    held_by_broker = broker.takes_countdown(delay)
    marked = held_by_broker and broker.lists_held_messages()  # as a retry's (jobs.worker.execution)
    wake_at = ledger.sleep(
        job_id=job_id,
        name=sleep.name,
        position=sleep.position,
        wake_at=sleep.wake_at,
        attempt=attempt,
        lease_owner=outcomes.lease_owner(task),
        run_seconds=run_seconds,
        publishing=marked,
        kind=sleep.kind,
        event=sleep.event,
    )
    if wake_at is None:
        refused("sleep", job_id, attempt)
        return
    logger.info("Job %s sleeps until %s (%s)", job_id, wake_at.isoformat(), sleep.name)
    woke = wake_at < sleep.wake_at  # a wait signalled while it ran: due now, sent now
    if not (held_by_broker or woke):
        return
    # The resumed run reads the same retry number: a sleep is not a failed attempt.
    options = {"retries": task.request.retries or 0}
    # the sleep gave the run's attempt back (jobs.ledger.steps.sleep): the row has attempt - 1
    if not resend(
        task, args, kwargs, wake_at, options, mark_published=not marked, attempt=attempt - 1
    ):
        ledger.unpublish(job_id)  # the broker is away: the relay publishes it when due
