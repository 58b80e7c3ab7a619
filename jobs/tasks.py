"""The platform's own periodic jobs."""

from typing import Any

from celery import shared_task
from django.contrib.auth import get_user_model

from jobs.core.policies import RetryPolicy
from jobs.flow.backends import standard_task  # noqa: F401  (registers the Tasks API runner)
from jobs.flow.batches import current_batch
from jobs.flow.deadletters import dead_letter_replay_many
from jobs.flow.relay import job_relay
from jobs.flow.retention import retention_purge
from jobs.models import DeadLetter
from jobs.web.alerts import alerts_check
from jobs.worker.decorators import job


@shared_task(name="jobs.relay", ignore_result=True)
def relay() -> int:
    """Publish outbox rows, due scheduled jobs and jobs whose worker lease ran out."""
    return job_relay()


@job(name="jobs.replay_matching", bind=True, time_limit=3600, retry=RetryPolicy(max_attempts=3))
def replay_matching(
    self: Any, filters: dict[str, str], user_id: int | None = None
) -> dict[str, Any]:
    """Replay every unresolved dead letter matching operator filters (admin, command). Sent
    as a member of a batch (the admin's), the replays join that batch: its counters are the
    bulk replay's progress, and it completes once every replay has ended."""
    user = get_user_model().objects.filter(pk=user_id).first() if user_id else None
    batch = current_batch()
    outcome = dead_letter_replay_many(
        queryset=DeadLetter.objects.matching(filters),
        by=user,
        progress=self.progress,
        batch=batch.id if batch is not None else None,
    )
    return {
        "replayed": outcome.done,
        "skipped": outcome.skipped,
        "errors": (outcome.errors or [])[:20],
    }


@shared_task(name="jobs.retention", ignore_result=True)
def retention() -> dict[str, int]:
    """Daily: delete finished history past its retention (jobs.retention)."""
    return retention_purge()


@shared_task(name="jobs.health_watch", ignore_result=True)
def health_watch() -> dict[str, list[str]]:
    """Every 30 s: alert on degraded health, once per cause per interval."""
    return alerts_check()
