"""The platform's own periodic jobs."""

from celery import shared_task

from . import services


@shared_task(name="jobs.relay", ignore_result=True)
def relay() -> int:
    """Publish outbox rows, due scheduled jobs and jobs whose worker lease ran out."""
    return services.job_relay()
