"""Handing accepted jobs to the broker: one job's message (the enqueue's publish after commit,
the relay's re-send, a retry's), or a rate- or concurrency-limited job parked at its gate
instead (jobs.broker.slots). Below jobs.enqueue.submit, which accepts them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from django.utils import timezone

from jobs import ledger
from jobs.broker import broker, running, slots
from jobs.core.policies import RetryPolicy
from jobs.models import Job


class Enqueueable(broker.Publishable, Protocol):
    """What enqueue needs of a task (PlatformTask has it)."""

    track: bool
    default_priority: int
    policy: RetryPolicy


def publish_job(
    *,
    job: Job,
    task: Enqueueable,
    options: Mapping[str, Any] | None = None,
    mark_published: bool = True,
    answered: bool = True,
) -> bool:
    """Hand a job's message to the broker and mark its row published; False (the row stays
    in the outbox) when the broker is unavailable. `answered`: see broker.publish."""
    now = timezone.now()
    eta = job.scheduled_for if job.scheduled_for and job.scheduled_for > now else None
    if eta is None and slots.limited(task) and park_at_gates(task, [job], options):
        sent = (
            True  # it waits at its gate, which publishes it when its slot comes (jobs.broker.slots)
        )
    else:
        sent = broker.publish(
            task=task,
            job_id=str(job.id),
            args=job.args,
            kwargs=job.kwargs,
            queue=job.queue,
            priority=job.priority,
            eta=eta,
            # a job that ran before (the relay's re-send of a retry) says so: Celery's
            # request.retries is the runs before this one, whichever copy runs it
            options={
                **({"retries": job.attempts} if job.attempts else {}),
                **(job.publish_options or {}),
                **dict(options or {}),
            },
            trace_context=job.trace_context,
            answered=answered,
        )
    if sent and task.track and mark_published:
        ledger.mark_published([job.id], now=now, attempts=job.attempts)
    return sent


def with_born(
    task: Enqueueable, options: Mapping[str, Any] | None, owner_id: int | None
) -> Mapping[str, Any] | None:
    """`options` with the header of a message sent right after its row was written waiting
    with no attempt (jobs.broker.running.born: its first delivery may skip reading the row);
    not for a job behind a rate or concurrency gate, whose runs claim as before."""
    born = running.born(owner_id)
    if not born or slots.limited(task):
        return options
    options = dict(options or {})
    options["headers"] = {**(options.get("headers") or {}), **born}
    return options


def park_at_gates(
    task: Enqueueable, jobs: Sequence[Job], options: Mapping[str, Any] | None
) -> set[str]:
    """Park due jobs of a rate- or concurrency-limited task at their gates instead of the
    queue; returns the ids parked: none when Redis is unavailable, and none of a call its
    limits leave unlimited (a mapping without its key or "*"): those are published as usual."""
    parked = slots.park(
        task,
        [
            slots.Parking(
                job_id=str(job.id),
                args=job.args,
                kwargs=job.kwargs,
                queue=job.queue,
                priority=job.priority,
                options={**(job.publish_options or {}), **dict(options or {})},
                trace=job.trace_context,
            )
            for job in jobs
        ],
    )
    return set(parked)
