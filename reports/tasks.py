"""Report jobs: thin wrappers that unpack ids and call reports.services (which never import this).

Each `<thing>_job` keeps the Celery name it was registered under (reports.schedules names
"reports.scheduled"), and hands the services the jobs they chain to. A requested report is a
render job chained to an email job; a scheduled one is one job of durable steps (report, query,
render, email). Each job's on_dead and on_cancelled hooks leave its report saying so: before
the PDF is ready they fail or cancel the report, after it they keep the PDF and say why it was
not emailed; a scheduled run that dies before it made its report leaves a failed report of the
schedule.
"""

from __future__ import annotations

from typing import Any

from django.db.utils import InterfaceError, OperationalError

from emails.tasks import email_send_job
from jobs import DEFAULT_RETRY_ON, RetryPolicy, current_job_id, job

from . import services

# Rendering fails for good on bad data or a template error (retrying cannot help); it is
# retried when the database connection drops or a time limit hit a busy machine.
RENDER_POLICY = RetryPolicy(
    max_attempts=3,
    base_delay=10,
    max_delay=120,
    retry_on=(*DEFAULT_RETRY_ON, OperationalError, InterfaceError),
)


def _render_gave_up(exc: BaseException, args: tuple, kwargs: dict) -> None:
    services.report_render_failed(report_id=args[0], error=f"{type(exc).__name__}: {exc}")


def _render_cancelled(args: tuple, kwargs: dict) -> None:
    services.report_cancelled(report_id=int(kwargs.get("report_id") or args[0]))


def _email_gave_up(exc: BaseException, args: tuple, kwargs: dict) -> None:
    services.report_email_stopped(
        report_id=int(kwargs.get("report_id") or args[0]),
        reason=f"the email step gave up: {type(exc).__name__}: {exc}",
    )


def _email_cancelled(args: tuple, kwargs: dict) -> None:
    services.report_email_stopped(
        report_id=int(kwargs.get("report_id") or args[0]),
        reason="the email step was cancelled: the PDF was not emailed",
        cancelled=True,
    )


def _scheduled_named(args: tuple, kwargs: dict) -> dict[str, Any]:
    # (kind, days=1, timezone="UTC"), as reports.schedules sends them
    named = dict(zip(("kind", "days", "timezone"), args, strict=False)) | kwargs
    return {
        "kind": str(named.get("kind", "")),
        "days": int(named.get("days", 1)),
        "zone": str(named.get("timezone", "UTC")),
    }


def _scheduled_gave_up(exc: BaseException, args: tuple, kwargs: dict) -> None:
    services.report_schedule_stopped(
        job_id=current_job_id(),
        **_scheduled_named(args, kwargs),
        error=f"the scheduled job gave up: {type(exc).__name__}: {exc}",
    )


def _scheduled_cancelled(args: tuple, kwargs: dict) -> None:
    services.report_schedule_stopped(
        job_id=current_job_id(),
        **_scheduled_named(args, kwargs),
        error="the scheduled job was cancelled: the PDF was not emailed",
        cancelled=True,
    )


# Measured: a year-long operations report over 100,000 ledger rows renders in ~0.8 s, a year
# of sales in ~0.6 s (2-page PDFs); 5 minutes leaves room for a busy host and a far larger ledger.
@job(
    name="reports.render",
    queue="reports",
    bind=True,
    time_limit=300,
    retry=RENDER_POLICY,
    on_dead=_render_gave_up,
    on_cancelled=_render_cancelled,
)
def report_render_job(self: Any, report_id: int) -> dict[str, Any]:
    return services.report_render(
        report_id=report_id, progress=self.progress, job_id=self.request.id
    )


@job(
    name="reports.email",
    queue="reports",
    time_limit=60,
    retry=RetryPolicy(
        max_attempts=5, base_delay=5, max_delay=300, retry_on=(*DEFAULT_RETRY_ON, OperationalError)
    ),
    on_dead=_email_gave_up,
    on_cancelled=_email_cancelled,
)
def report_email_job(report_id: int) -> int:
    return services.report_email(report_id=report_id, send_job=email_send_job)


@job(
    name="reports.scheduled",
    queue="reports",
    priority=services.SCHEDULED_PRIORITY,
    bind=True,
    time_limit=300,
    retry=RENDER_POLICY,
    on_dead=_scheduled_gave_up,
    on_cancelled=_scheduled_cancelled,
)
def report_scheduled_job(self: Any, kind: str, days: int = 1, timezone: str = "UTC") -> int:
    """Started by celery beat (reports.schedules): make the report, query its figures, lay
    out its PDF, email it: four durable steps, so that a retry or a dead letter's replay
    after a failed layout or email does not query (or render) again."""
    report_id: int = self.step(
        "report",
        services.report_schedule_make,
        kind=kind,
        days=days,
        zone=timezone,
        trigger_job_id=self.request.id,
    )
    services.report_job_follow(report_id=report_id, job_id=self.request.id)
    figures = self.step(
        "query",
        services.report_figures,
        report_id=report_id,
        progress=self.progress,
        job_id=self.request.id,
    )
    self.step(
        "render",
        services.report_lay_out,
        report_id=report_id,
        figures=figures,
        progress=self.progress,
    )
    if services.report_has_recipients(report_id=report_id):  # stored: the same on every run
        self.step("email", services.report_email, report_id=report_id, send_job=email_send_job)
    return report_id
