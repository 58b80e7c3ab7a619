"""What happens once: the idempotency key an enqueue takes (IdempotencyRecord), and an effect
recorded in the transaction of its writes (Effect, jobs.worker.effects)."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import models
from django.utils import timezone

from jobs.core.states import ACTIVE_STATES, JobState
from jobs.models.job import Job


class IdempotencyRecord(models.Model):
    """A unique (task, key) pair pointing at the job it started.

    Inserted in the enqueue's transaction; an IntegrityError means another enqueue holds the key.
    """

    key = models.CharField(
        "key", max_length=460, unique=True, help_text="Task name and caller's key."
    )
    job = models.ForeignKey(
        Job,
        on_delete=models.CASCADE,
        related_name="+",
        verbose_name="job",
        help_text="The job that holds the key.",
    )
    created_at = models.DateTimeField("created", default=timezone.now, help_text="Taken.")

    class Meta:
        verbose_name = "idempotency record"
        verbose_name_plural = "idempotency records"

    def __str__(self) -> str:
        return self.key

    def holds(self, ttl: timedelta, now: datetime | None = None) -> bool:
        """Whether the key still de-duplicates: job active, or succeeded within the TTL."""
        job = self.job
        if job.state in ACTIVE_STATES:
            return True
        if job.state == JobState.SUCCEEDED:
            return (now or timezone.now()) - (job.finished_at or job.enqueued_at) < ttl
        return False


class Effect(models.Model):
    """An effect that happened once, recorded in the same transaction as the effect's writes."""

    key = models.CharField("key", max_length=255, unique=True, help_text="Names the effect.")
    job_id = models.UUIDField(
        "job id", null=True, blank=True, help_text="Job that applied it, when run inside one."
    )
    created_at = models.DateTimeField("applied", default=timezone.now, help_text="When.")

    class Meta:
        verbose_name = "effect"
        verbose_name_plural = "effects"

    def __str__(self) -> str:
        return self.key
