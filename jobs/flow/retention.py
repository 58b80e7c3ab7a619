"""Retention: finished history is deleted by age so the database and Redis stay bounded.

Unresolved dead letters (and the ledger rows they point at) are kept until an operator acts.
A batch goes with its last member: once it completed longer ago than the job retention and
none of its members is left in the ledger (a member kept for its unresolved dead letter keeps
its batch, which a replay may still bring to success).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from celery import current_app
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone
from django_celery_results.models import TaskResult

from jobs.core.conf import backlot_settings
from jobs.models import Batch, DeadLetter, DeadLetterStatus, Effect, Job

# Rows per DELETE: 5,000 keeps each statement well under a second on PostgreSQL here and does
# not hold locks that would stall workers writing the ledger.
DELETE_BATCH = 5000


def _result_expiry() -> timedelta:
    """Celery's result_expires (seconds or a timedelta; None: a day, Celery's default)."""
    expires = current_app.conf.result_expires
    if isinstance(expires, timedelta):
        return expires
    return timedelta(seconds=float(expires or 86400))


def _delete_in_batches(queryset: Any, dry_run: bool) -> int:
    if dry_run:
        return queryset.count()
    total = 0
    while True:
        ids = list(queryset.values_list("pk", flat=True)[:DELETE_BATCH])
        if not ids:
            return total
        total += (
            queryset.model.objects.filter(pk__in=ids).delete()[1].get(queryset.model._meta.label, 0)
        )


def retention_purge(*, dry_run: bool = False) -> dict[str, int]:
    """Delete what retention allows; returns rows deleted (or that would be) per kind."""
    now = timezone.now()
    limits = backlot_settings()
    job_cutoff = now - timedelta(days=limits.JOB_RETENTION_DAYS)
    dead_cutoff = now - timedelta(days=limits.DEAD_LETTER_RETENTION_DAYS)
    # enqueued_at before the cutoff follows from finished_at before it; it is what an index
    # can read (job_enqueued_brin on PostgreSQL): jobs_job has no index on finished_at, which
    # every finish changes (jobs.models.active says why).
    jobs = (
        Job.objects.finished()
        .filter(finished_at__lt=job_cutoff, enqueued_at__lt=job_cutoff)
        .exclude(dead_letter__status=DeadLetterStatus.DEAD)
    )
    resolved = DeadLetter.objects.filter(
        ~Q(status=DeadLetterStatus.DEAD), resolved_at__lt=dead_cutoff
    )
    effects = Effect.objects.filter(
        created_at__lt=now - timedelta(days=limits.EFFECT_RETENTION_DAYS)
    )
    results = TaskResult.objects.filter(date_done__lt=now - _result_expiry())
    counts = {
        "dead_letters": _delete_in_batches(resolved, dry_run),
        "jobs": _delete_in_batches(jobs, dry_run),
        "effects": _delete_in_batches(effects, dry_run),
        "results": _delete_in_batches(results, dry_run),
    }
    # After the jobs: members deleted above free their batch in the same purge. A dry run
    # counts the batches free now plus those whose last members it would delete.
    batches = Batch.objects.filter(completed_at__lt=job_cutoff).exclude(
        Exists(Job.objects.filter(batch=OuterRef("pk")).exclude(pk__in=jobs.values("pk")))
        if dry_run
        else Exists(Job.objects.filter(batch=OuterRef("pk")))
    )
    counts["batches"] = _delete_in_batches(batches, dry_run)
    return counts
