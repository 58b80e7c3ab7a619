"""Writes of a job's durable steps (jobs.worker.steps): a step started, succeeded or failed, a
durable sleep (the run ends, the row is scheduled for its wake-up), and a replay's copy of the
dead job's finished steps.

Each write of a run is fenced like the run's other writes: in one transaction, the run's lease
is renewed matching its attempt and claim token (the UPDATE locks the job's row), and the step
is written only if that renewal matched; a run that lost its claim writes nothing (False)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from jobs.core.states import FINISHED_STATES, JobState, sources, target
from jobs.ledger.busy import busy_retried
from jobs.ledger.run import describe_exception, renew
from jobs.models import Job, JobSignal, JobStep, StepState


def _fenced(job_id: str, attempt: int, lease_owner: str | None, lease_seconds: float) -> bool:
    return renew(
        job_id=job_id, attempt=attempt, lease_seconds=lease_seconds, lease_owner=lease_owner
    )


@busy_retried  # SQLite's "database is locked" is waited out
def step_started(
    *,
    job_id: str,
    name: str,
    position: int,
    attempt: int,
    lease_owner: str | None,
    lease_seconds: float,
    kind: str = "step",
) -> bool:
    """A step starts (again): running, one more attempt, in this run's claim; False when this
    run no longer holds the job (nothing written)."""
    now = timezone.now()
    with transaction.atomic():
        if not _fenced(job_id, attempt, lease_owner, lease_seconds):
            return False
        updated = JobStep.objects.filter(job_id=job_id, name=name).update(
            state=StepState.RUNNING,
            attempts=F("attempts") + 1,
            job_attempt=attempt,
            started_at=now,
            finished_at=None,
        )
        if not updated:
            JobStep.objects.create(
                job_id=job_id,
                name=name,
                position=position,
                kind=kind,
                state=StepState.RUNNING,
                attempts=1,
                job_attempt=attempt,
                started_at=now,
            )
    return True


@busy_retried
def step_succeeded(
    *,
    job_id: str,
    name: str,
    result: Any,
    attempt: int,
    lease_owner: str | None,
    lease_seconds: float,
) -> bool:
    """From running to succeeded, with its JSON result (checked by the caller for size)."""
    size = len(json.dumps(result, cls=DjangoJSONEncoder, separators=(",", ":")).encode())
    with transaction.atomic():
        if not _fenced(job_id, attempt, lease_owner, lease_seconds):
            return False
        JobStep.objects.filter(job_id=job_id, name=name).update(
            state=StepState.SUCCEEDED,
            finished_at=timezone.now(),
            error="",
            result=result,
            result_bytes=size,
        )
    return True


@busy_retried
def step_failed(
    *,
    job_id: str,
    name: str,
    exc: BaseException,
    attempt: int,
    lease_owner: str | None,
    lease_seconds: float,
) -> bool:
    """From running to failed, with the exception (the job's retry policy decides the rest)."""
    exception, message = describe_exception(exc)
    with transaction.atomic():
        if not _fenced(job_id, attempt, lease_owner, lease_seconds):
            return False
        JobStep.objects.filter(job_id=job_id, name=name).update(
            state=StepState.FAILED, error=f"{exception}: {message}"[:2000]
        )
    return True


@busy_retried
def sleep_ended(
    *, job_id: str, name: str, attempt: int, lease_owner: str | None, lease_seconds: float
) -> bool:
    """A durable sleep whose time came: from sleeping to succeeded (the job's code goes on)."""
    with transaction.atomic():
        if not _fenced(job_id, attempt, lease_owner, lease_seconds):
            return False
        JobStep.objects.filter(job_id=job_id, name=name).update(
            state=StepState.SUCCEEDED, finished_at=timezone.now()
        )
    return True


@busy_retried
def sleep(
    *,
    job_id: str,
    name: str,
    position: int,
    wake_at: datetime,
    attempt: int,
    lease_owner: str | None,
    run_seconds: float,
    publishing: bool = False,
    kind: str = "sleep",
    event: str | None = None,
) -> datetime | None:
    """From running to scheduled for `wake_at`, with the sleep's step, in one transaction; None
    when this run no longer holds the claim (nothing written), else the wake-up time.

    `kind` "wait" (self.wait_for(event)): `wake_at` is its timeout, and a signal of `event`
    already sent (jobs.signal, which locks the row as this UPDATE does) wakes it at once.

    Not a failed attempt: the claim counted this run as one, the sleep gives it back, so the
    run that resumes has this run's attempt number and max_attempts counts failures only.
    `publishing`: the caller hands the broker the wake-up's message (a countdown) right after
    this write (see retry_later); otherwise the relay publishes the row when it is due."""
    now = timezone.now()
    with transaction.atomic():
        held = Job.objects.filter(id=job_id, state__in=sources("sleep"), attempts=attempt)
        if lease_owner is not None:
            held = held.filter(lease_owner=lease_owner)
        if not held.update(
            state=target("sleep"),
            scheduled_for=wake_at,
            published_at=now if publishing else None,
            lease_expires_at=None,
            attempts=F("attempts") - 1,
            run_seconds=run_seconds,
        ):
            return None
        if event is not None and JobSignal.objects.filter(job_id=job_id, name=event).exists():
            wake_at = now  # signalled while it ran: it wakes at once
            Job.objects.filter(id=job_id).update(scheduled_for=wake_at)
        JobStep.objects.update_or_create(
            job_id=job_id,
            name=name,
            defaults={"state": StepState.SLEEPING, "wake_at": wake_at, "job_attempt": attempt},
            create_defaults={
                "position": position,
                "kind": kind,
                "state": StepState.SLEEPING,
                "wake_at": wake_at,
                "attempts": 1,
                "job_attempt": attempt,
                "started_at": now,
            },
        )
    return wake_at


@busy_retried
def signal_sent(*, job_id: str, name: str, payload: Any, step: str) -> str:
    """Keep an event for a job, once per name: "missing" (no such job), "finished", "duplicate"
    (the first signal of the name wins), "woke" (the job was parked in its wait `step`: it is
    now due, its row left unpublished for the caller or the relay to send), or "kept" (for
    when the job waits for it). Locks the job's row, as the park of a wait does."""
    now = timezone.now()
    with transaction.atomic():
        job = Job.objects.select_for_update().only("state").filter(id=job_id).first()
        if job is None:
            return "missing"
        if job.state in FINISHED_STATES:
            return "finished"
        try:
            with transaction.atomic():
                JobSignal.objects.create(job_id=job_id, name=name, payload=payload, sent_at=now)
        except IntegrityError:
            return "duplicate"
        parked = JobStep.objects.filter(job_id=job_id, name=step, state=StepState.SLEEPING)
        if job.state == JobState.SCHEDULED and parked.exists():
            Job.objects.filter(id=job_id, state=JobState.SCHEDULED).update(
                scheduled_for=now, published_at=None
            )
            return "woke"
    return "kept"


def steps_copied(*, pairs: Iterable[tuple[Any, Any]]) -> int:
    """A replay's new job gets its dead job's finished steps (a replay does not run them
    again), each marked copied_from the job it came from; `pairs` are (dead job, new job)
    ids. Run in the replay's transaction, before the new job's message is published."""
    pairs = [(str(old), str(new)) for old, new in pairs if old is not None and new is not None]
    if not pairs:
        return 0
    new_of: dict[str, list[str]] = {}
    for old, new in pairs:
        new_of.setdefault(old, []).append(new)
    copies = [
        JobStep(
            job_id=new,
            name=step.name,
            position=step.position,
            kind=step.kind,
            state=step.state,
            attempts=step.attempts,
            job_attempt=step.job_attempt,
            started_at=step.started_at,
            finished_at=step.finished_at,
            wake_at=step.wake_at,
            result=step.result,
            result_bytes=step.result_bytes,
            copied_from=step.copied_from or step.job_id,
        )
        for step in JobStep.objects.finished().filter(job_id__in=list(new_of))
        for new in new_of[str(step.job_id)]
    ]
    JobStep.objects.bulk_create(copies, ignore_conflicts=True)
    return len(copies)
