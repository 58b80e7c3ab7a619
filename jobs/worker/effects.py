"""Effects-once: record an effect in the same transaction as the writes that make it.

    with effect_once(f"invoice-paid:{order_id}") as effect:
        if effect.done:
            return            # a redelivery or a replay: already applied
        order.mark_paid()     # these writes and the effect record commit together

For an external side effect (a payment provider, an email API), pass the same key to the
provider as its idempotency key, so a retry after a crash between the call and the commit is
recognized by the provider.

Inside a job's run the effect is fenced by the run's claim: a run that lost it (its lease
lapsed and another run took the job over) gets LeaseLost instead of the block, and the claim is
checked again, row locked, in the block's own transaction before it commits. So the effect
record and the block's writes commit only while this run holds the job; the run that took it
over finds them done, or applies them itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from celery import current_task
from django.db import IntegrityError, transaction

from jobs.core.exceptions import LeaseLost
from jobs.models import Effect
from jobs.worker.lease import current, refused, renewer


@dataclass
class EffectRecord:
    key: str
    done: bool  # True: applied before, skip the body's work


@contextmanager
def effect_once(key: str) -> Iterator[EffectRecord]:
    """Run the body's database writes at most once per key; see the module docstring."""
    if not key or len(key) > 255:
        raise ValueError("effect key must be 1-255 characters")
    task = current_task
    job_id = getattr(getattr(task, "request", None), "id", None)
    hold = current() or (renewer.held(job_id) if job_id else None)
    if hold is not None:
        try:
            hold.check()  # a run known to be lost does not start the block
            hold.claim_now()  # a deferred claim is written before, not in, the block
        except LeaseLost:
            refused("effect", hold.job_id, hold.attempt)
            raise
    with transaction.atomic():
        try:
            with transaction.atomic():
                Effect.objects.create(key=key, job_id=job_id)
        except IntegrityError:
            yield EffectRecord(key=key, done=True)
            return
        yield EffectRecord(key=key, done=False)
        if hold is not None:
            try:
                hold.fence()  # the same transaction: rolled back with the block if lost
            except LeaseLost:
                refused("effect", hold.job_id, hold.attempt)
                raise


def effect_applied(key: str) -> bool:
    return Effect.objects.filter(key=key).exists()
