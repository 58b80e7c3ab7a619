"""A dead job as one Sentry event: a receiver of jobs.core.events.job_dead that reports the final
exception, tagged with the job's id, task, queue and attempt, its arguments masked.

Active when sentry-sdk is installed (``pip install backlot[sentry]``) and the host project has
called ``sentry_sdk.init`` (the reference project does when SENTRY_DSN is set); otherwise the
receiver returns at once. Retries send nothing: only giving up is an error.

One event per dead job, not two: after the dead letter the worker re-raises the exception to
Celery, whose failure log line (``celery.app.trace``, ERROR, with the traceback) Sentry's logging
integration would report again, and so would Sentry's Celery integration where a host enables
it. The exception is marked once reported, and a filter drops any later event carrying it, as
it drops the ``backlot.jobs`` ERROR line about the same dead job.
"""

from __future__ import annotations

import functools
import logging
import sys
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.utils import timezone

from jobs.core import events
from jobs.core.masking import mask_value
from jobs.models import DeadLetter

if TYPE_CHECKING:
    from sentry_sdk._types import Event, EventProcessor, Hint

logger = logging.getLogger(__name__)

REPORTED = "_backlot_reported"  # set on an exception once its dead job's event was captured
JOB_LOGGER = "backlot.jobs"  # jobs.worker.telemetry's lines; its dead-job line repeats the event
RUN_MARGIN = 0.25  # s before a run's measured start still counted as its (claim, start line)


def report_dead(
    sender: str,
    *,
    job_id: str,
    queue: str,
    attempt: int,
    exception: BaseException,
    dead_letter_id: int | None = None,
    duration: float | None = None,
    **kwargs: Any,
) -> None:
    """Capture the dead job's exception as one Sentry event (a no-op without an active SDK)."""
    import sentry_sdk

    if not sentry_sdk.get_client().is_active():
        return
    arguments = (
        DeadLetter.objects.filter(pk=dead_letter_id).values("args", "kwargs").first()
        if dead_letter_id is not None
        else None
    )
    with sentry_sdk.new_scope() as scope:
        for name, value in (("job_id", job_id), ("task", sender), ("queue", queue)):
            scope.set_tag(name, value)
        scope.set_tag("attempt", str(attempt))
        scope.set_context(
            "job",
            {
                "id": job_id,
                "task": sender,
                "queue": queue,
                "attempt": attempt,
                "dead_letter_id": dead_letter_id,
                **(mask_value(arguments) if arguments else {}),
            },
        )
        # The run began `duration` ago; its "job started" line a moment before that.
        began = timezone.now() - timedelta(seconds=(duration or 0) + RUN_MARGIN)
        scope.add_event_processor(_this_run(since=began))
        sentry_sdk.capture_exception(exception)
    # The run is still handling what it caught (a soft time limit is reported as TimeLimitHit):
    # what it re-raises to Celery is marked as well.
    for reported in (exception, sys.exc_info()[1]):
        if reported is not None:
            _mark(reported)


def _this_run(since: datetime) -> EventProcessor:
    """The event processor of a dead job's event: its breadcrumbs from this run only, every
    string masked."""

    def process(event: Event, hint: Hint) -> Event:
        # A worker process runs one job after another in one Sentry scope: breadcrumbs (log
        # lines) from the jobs it ran before would read as this one's.
        breadcrumbs = event.get("breadcrumbs")
        if isinstance(breadcrumbs, dict) and breadcrumbs.get("values"):
            breadcrumbs["values"] = [
                crumb
                for crumb in breadcrumbs["values"]
                if not isinstance(stamp := crumb.get("timestamp"), datetime) or stamp >= since
            ]
        # The exception's message and the frames' local variables (the run's args and kwargs)
        # quote the arguments too: mask the whole event, not only the job context.
        masked: Event = mask_value(event)
        return masked

    return process


def _mark(exc: BaseException) -> None:
    try:
        setattr(exc, REPORTED, True)
    except (AttributeError, TypeError):  # an exception type that takes no attributes
        logger.debug("Could not mark %s as reported", type(exc).__name__)


def _drop_repeats(event: Event, hint: Hint | None) -> Event | None:
    """Global event processor: no second event for a dead job already reported."""
    exc_info = (hint or {}).get("exc_info")
    if exc_info and getattr(exc_info[1], REPORTED, False):
        return None
    if event.get("logger") == JOB_LOGGER and not exc_info:
        return None  # the dead-job log line (ERROR): report_dead sends the event
    return event


@functools.cache
def _install_filter() -> None:
    """Once per process: the SDK keeps global event processors for the process' lifetime."""
    from sentry_sdk.scope import add_global_event_processor

    add_global_event_processor(_drop_repeats)


def connect() -> None:
    """Report dead jobs to Sentry when sentry-sdk is installed (idempotent)."""
    try:
        import sentry_sdk  # noqa: F401
    except ImportError:
        return
    _install_filter()
    events.job_dead.connect(report_dead, dispatch_uid="backlot-errors-dead")
