"""Report work: request, render to PDF, email, schedule, status; views, tasks, tests call it."""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

from django.core.files.storage import default_storage
from django.db import IntegrityError, transaction
from django.template.loader import render_to_string
from django.utils import timezone

from emails.services import email_queue
from jobs import AlreadyFinished, Cancellation, Permanent, cancel, effect_once
from jobs.models import Job

from . import conf
from .access import report_request_authorize
from .exceptions import ReportInputError, ReportNotReady
from .figures import figures_dump, figures_load
from .kinds import kind_spec
from .models import Report, ReportKind, ReportOrigin, ReportStatus
from .rendering import pdf_file_name, pdf_write
from .schemas import ReportRequest, params_parse

if TYPE_CHECKING:
    # PlatformTask[P, R] is what @job returns: a job passed in is checked against its arguments.
    from jobs import PlatformTask

logger = logging.getLogger(__name__)

Progress = Callable[[int, int | None, str], None]

# A person waits for a report they asked for; a scheduled one can wait behind them.
REQUESTED_PRIORITY = 7
SCHEDULED_PRIORITY = 4
EMAIL_TEMPLATE = "report_ready"


def report_request(
    *,
    request: ReportRequest,
    owner: Any,
    origin: str = ReportOrigin.API,
    render_job: PlatformTask[[int], dict[str, Any]],
    email_job: PlatformTask[[int], int],
) -> tuple[Report, str]:
    """Accept a report `owner` asks for: write its row and enqueue its render job in one
    transaction.

    Returns the report and the render job's id. The message is sent after commit. The jobs
    are reports.tasks.report_render_job and report_email_job (see report_enqueue). A request
    `owner` may not make (reports.access: the kind's permission, the email rule) raises
    ReportPermissionDenied, and nothing is written or enqueued.
    """
    report_request_authorize(request=request, user=owner)
    with transaction.atomic():
        report = Report.objects.create(
            kind=request.kind,
            params=request.params_json(),
            owner=owner if getattr(owner, "pk", None) else None,
            origin=origin,
            email_to=list(request.email_to),
        )
        job_id = report_enqueue(
            report=report,
            priority=REQUESTED_PRIORITY,
            render_job=render_job,
            email_job=email_job,
        )
    logger.info("Report %s (%s) requested; render job %s", report.pk, report.kind, job_id)
    return report, job_id


def report_enqueue(
    *,
    report: Report,
    priority: int = REQUESTED_PRIORITY,
    render_job: PlatformTask[[int], dict[str, Any]],
    email_job: PlatformTask[[int], int],
) -> str:
    """Enqueue `render_job`; with recipients, as a chain: render, then `email_job` the PDF.

    Call inside the transaction that wrote the report: the messages go out after commit.
    """
    if report.email_to:
        job_id = str(uuid.uuid4())
        render = render_job.si(report.pk).set(task_id=job_id, priority=priority)
        # The email step runs only once the render succeeded (a failed render breaks the chain).
        (render | email_job.si(report.pk).set(priority=priority)).apply_async()
    else:
        job_id = render_job.using(owner=report.owner, priority=priority).enqueue(report.pk).id
    report.mark_queued(job_id=job_id)
    return job_id


def report_render(
    *, report_id: int, progress: Progress | None = None, job_id: str | None = None
) -> dict[str, Any]:
    """Compute the report's figures, lay out its template as a PDF and store it.

    A report that is already ready (a redelivered message) is not rendered again. Progress
    goes through `progress(done, total, message)`, one step per section and per PDF stage.
    `job_id` (the running job) becomes the report's render job, so that the status follows
    a replay of a failed render.
    """
    report = Report.objects.get(pk=report_id)
    if _rendered_or_cancelled(report):
        return _render_summary(report)
    started = time.monotonic()
    counter = _Counter(report, progress)
    context = _figures(report, counter, job_id)
    return _lay_out(report, context, counter, started)


def report_figures(
    *, report_id: int, progress: Progress | None = None, job_id: str | None = None
) -> dict[str, Any] | None:
    """The report's figures as JSON (reports.figures): the scheduled job's "query" step, kept
    by the ledger so that a retried layout does not query again. None when the report is
    already ready or was cancelled (nothing to lay out)."""
    report = Report.objects.get(pk=report_id)
    if _rendered_or_cancelled(report):
        return None
    figures: dict[str, Any] = figures_dump(_figures(report, _Counter(report, progress), job_id))
    return figures


def report_lay_out(
    *, report_id: int, figures: dict[str, Any] | None, progress: Progress | None = None
) -> dict[str, Any]:
    """Lay out the report's template over `figures` (report_figures) as a PDF and store it:
    the scheduled job's "render" step."""
    report = Report.objects.get(pk=report_id)
    if figures is None or _rendered_or_cancelled(report):
        return _render_summary(report)
    report.mark_rendering()
    counter = _Counter(report, progress, done=len(kind_spec(report.kind).sections))
    return _lay_out(report, figures_load(figures), counter, time.monotonic())


def _rendered_or_cancelled(report: Report) -> bool:
    if (
        report.status == ReportStatus.READY
        and report.file
        and default_storage.exists(report.file.name)
    ):
        logger.info("Report %s is already rendered; nothing to do", report.pk)
        return True
    if report.status == ReportStatus.CANCELLED:
        logger.info("Report %s was cancelled; not rendered", report.pk)
        return True
    return False


class _Counter:
    """A render's progress: one step per section, then HTML, layout and the PDF file."""

    def __init__(self, report: Report, progress: Progress | None, done: int = 0) -> None:
        self.progress, self.done = progress, done
        self.total = len(kind_spec(report.kind).sections) + 3

    def __call__(self, message: str) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total, message)


def _figures(report: Report, counter: _Counter, job_id: str | None) -> dict[str, Any]:
    """The report's template context: its kind's figures over its parameters."""
    spec = kind_spec(report.kind)
    try:
        params = params_parse(report.kind, report.params)
    except ReportInputError as exc:
        raise Permanent(f"Report {report.pk} has invalid parameters: {exc}") from None
    report.mark_rendering(job_id=job_id)
    if counter.progress is not None:
        counter.progress(counter.done, counter.total, "computing figures")
    context: dict[str, Any] = spec.build(params, lambda section: counter(f"computed {section}"))
    return {**context, "params": params, "kind_title": spec.title}


def _lay_out(
    report: Report, context: dict[str, Any], counter: _Counter, started: float
) -> dict[str, Any]:
    """Render the template over `context`, write the PDF, mark the report ready."""
    html = render_to_string(kind_spec(report.kind).template, {**context, "report": report})
    counter("rendered HTML")
    created = report.created_at
    pdf = pdf_write(
        html=html,
        name=pdf_file_name(token=report.uid, year=created.year, month=created.month),
        on_step=counter,
    )
    seconds = time.monotonic() - started
    report.mark_ready(
        file_name=pdf.name, pages=pdf.pages, size_bytes=pdf.size_bytes, render_seconds=seconds
    )
    logger.info(
        "Report %s rendered: %s pages, %s bytes in %.2fs",
        report.pk,
        pdf.pages,
        pdf.size_bytes,
        seconds,
    )
    return _render_summary(report)


def _render_summary(report: Report) -> dict[str, Any]:
    return {
        "report_id": report.pk,
        "file": report.file.name,
        "pages": report.pages,
        "size_bytes": report.size_bytes,
        "render_seconds": report.render_seconds,
    }


def report_render_failed(*, report_id: int, error: str) -> None:
    """The render job gave up: the report is failed unless it was rendered meanwhile."""
    report = Report.objects.filter(pk=report_id).first()
    if report is not None:
        report.mark_failed(error=error)


def report_cancel(*, report: Report, by: Any = None) -> Cancellation:
    """Cancel a report's render job (and the email step chained to it, which never starts):
    a waiting one is cancelled at once, a rendering one stops at its next step. The job's hook
    (report_cancelled) marks the report. AlreadyFinished when the report has settled."""
    if report.is_final or report.job_id is None:
        raise AlreadyFinished(str(report.job_id or ""), report.status)
    try:
        return cancel(report.job_id, by=by)
    except Job.DoesNotExist:
        raise AlreadyFinished(str(report.job_id), report.status) from None


def report_cancelled(*, report_id: int) -> None:
    """The render job was cancelled: the report is cancelled, and a PDF the stopped run may
    have stored under the report's name is removed (nothing links to it)."""
    report = Report.objects.filter(pk=report_id).first()
    if report is None or not report.mark_cancelled():
        return
    created = report.created_at
    name = pdf_file_name(token=report.uid, year=created.year, month=created.month)
    if default_storage.exists(name):
        default_storage.delete(name)


def report_email_stopped(*, report_id: int, reason: str, cancelled: bool = False) -> None:
    """The email step was dead-lettered (or cancelled, `cancelled`): a ready report keeps its
    PDF and says why it was not emailed; one that never got ready ends failed (or cancelled)
    with the reason, like its render job would have left it."""
    report = Report.objects.filter(pk=report_id).first()
    if report is None:
        return
    if report.status == ReportStatus.READY:
        report.mark_email_stopped(error=reason)
    elif cancelled:
        report_cancelled(report_id=report_id)
    else:
        report.mark_failed(error=reason)


def report_schedule_failed(*, kind: str, days: int, zone: str, error: str) -> Report | None:
    """The scheduled job gave up before it made its report: a failed report of the schedule
    says so (operators see it in the report list and admin), unless `kind` is no report kind
    (nothing could show it; the dead letter and the log keep the reason)."""
    if kind not in ReportKind.values:
        logger.warning("Scheduled report of unknown kind %r gave up: %s", kind, error)
        return None
    now = timezone.now()
    report = Report.objects.create(
        kind=kind,
        params={"days": days, "timezone": zone},
        origin=ReportOrigin.SCHEDULE,
        status=ReportStatus.FAILED,
        error=error[:2000],
        finished_at=now,
    )
    logger.info("Scheduled %s report gave up; report %s records it", kind, report.pk)
    return report


def _recipient_key(report: Report, address: str) -> str:
    # The effect key names the recipient by a hash: no addresses in the effects table.
    digest = hashlib.sha256(address.strip().lower().encode()).hexdigest()[:24]
    return f"report-email:{report.uid.hex}:{digest}"


def report_email(*, report_id: int, send_job: PlatformTask[[int | str], str]) -> int:
    """Queue one email with the PDF attached per recipient, each sent by `send_job`
    (emails.tasks.email_send_job); returns how many were queued now.

    Each recipient's email is queued once: a rerun of this step (redelivery, replay) skips
    the addresses whose email was already accepted.
    """
    report = Report.objects.select_related("owner").get(pk=report_id)
    if report.status != ReportStatus.READY or not report.file:
        raise Permanent(f"Report {report_id} is {report.status}: there is no PDF to email")
    context = {
        "title": kind_spec(report.kind).title,
        "period": report.period_label,
        "pages": report.pages,
        "report_id": report.pk,
    }
    queued = 0
    for address in report.email_to:
        with effect_once(_recipient_key(report, address)) as effect:
            if effect.done:
                continue
            email_queue(
                to=address,
                template=EMAIL_TEMPLATE,
                context=context,
                subject=f"{kind_spec(report.kind).title}: {report.period_label}",
                attachments=[report.file.name],
                owner=report.owner,
                send_job=send_job,
            )
            queued += 1
    if report.emailed_at is None:
        report.mark_emailed()
    logger.info(
        "Report %s: %s email(s) queued, %s recipient(s) in all",
        report_id,
        queued,
        len(report.email_to),
    )
    return queued


def report_schedule_make(
    *,
    kind: str,
    days: int,
    zone: str,
    trigger_job_id: str,
    recipients: Sequence[str] | None = None,
) -> int:
    """A scheduled report's row: the last `days` whole days before today (in `zone`), to be
    emailed to the configured recipients. The scheduled job (`trigger_job_id`) renders and
    emails it in later steps, so it is the report's job (status, progress, cancel).

    Keyed by the scheduling job's id: a run that made the row but died before its step was
    recorded gets the same report back. Returns the report's id.
    """
    today = timezone.now().astimezone(ZoneInfo(zone)).date()
    end = today - timedelta(days=1)
    start = end - timedelta(days=max(1, days) - 1)
    try:
        params = params_parse(
            kind, {"start": start.isoformat(), "end": end.isoformat(), "timezone": zone}
        )
    except ReportInputError as exc:
        raise Permanent(f"Schedule for {kind!r} has invalid parameters: {exc}") from None
    recipients = conf.report_recipients() if recipients is None else list(recipients)
    try:
        with transaction.atomic():
            report = Report.objects.create(
                kind=kind,
                params=params.model_dump(mode="json"),
                origin=ReportOrigin.SCHEDULE,
                email_to=recipients,
                trigger_job_id=trigger_job_id,
                job_id=trigger_job_id,
            )
    except IntegrityError:
        report = Report.objects.get(trigger_job_id=trigger_job_id)
        logger.info("Scheduled run %s already created report %s", trigger_job_id, report.pk)
        return report.pk
    logger.info(
        "Scheduled %s report %s for %s, %s recipient(s)",
        kind,
        report.pk,
        params.label,
        len(recipients),
    )
    return report.pk


def report_job_follow(*, report_id: int, job_id: str) -> None:
    """Job `job_id` works on the report now (a dead scheduled job's replay is a new job that
    gets the finished steps back): its status, progress and cancel follow that job."""
    Report.objects.filter(pk=report_id).exclude(job_id=job_id).update(job_id=job_id)


def report_has_recipients(*, report_id: int) -> bool:
    return bool(Report.objects.filter(pk=report_id).values_list("email_to", flat=True).get())


def report_schedule_stopped(
    *,
    job_id: str | None,
    kind: str,
    days: int,
    zone: str,
    error: str,
    cancelled: bool = False,
) -> None:
    """Scheduled job `job_id` gave up (or was cancelled, `cancelled`). The report it works on
    says so: failed (or cancelled) before its PDF was ready, or ready with the reason it was
    not emailed; a run that gave up before it made its report leaves a failed report of the
    schedule (report_schedule_failed)."""
    report = Report.objects.filter(job_id=job_id).first() if job_id else None
    if report is not None:
        report_email_stopped(report_id=report.pk, reason=error, cancelled=cancelled)
    elif not cancelled:
        report_schedule_failed(kind=kind, days=days, zone=zone, error=error)


def report_status(*, report: Report) -> dict[str, Any]:
    """The status document of a report, with its render job's progress."""
    job = Job.objects.filter(id=report.job_id).first() if report.job_id else None
    if report.status == ReportStatus.READY:
        progress = {"done": 1, "total": 1, "percent": 100.0, "message": "ready"}
    elif job is not None:
        progress = {
            "done": job.progress_done,
            "total": job.progress_total,
            "percent": job.progress_percent,
            "message": job.progress_message,
        }
    else:
        progress = {"done": 0, "total": None, "percent": None, "message": ""}
    error = report.error or (job.error if job is not None and job.error else "")
    return {
        "report_id": report.pk,
        "kind": report.kind,
        "title": report.title,
        "params": report.params,
        "state": report.status,
        "progress": progress,
        "error": error or None,
        "job_id": str(report.job_id) if report.job_id else None,
        "job_state": job.state if job is not None else None,
        "attempts": job.attempts if job is not None else None,
        "max_attempts": job.max_attempts if job is not None else None,
        "created_at": report.created_at,
        "started_at": report.started_at,
        "finished_at": report.finished_at,
        "render_seconds": report.render_seconds,
        "pages": report.pages,
        "size_bytes": report.size_bytes,
        "emailed_at": report.emailed_at,
        "download_url": report.download_url,
    }


def report_file_open(*, report: Report) -> Any:
    """The stored PDF, opened for reading; ReportNotReady when there is none."""
    if report.status != ReportStatus.READY or not report.file:
        raise ReportNotReady(f"Report {report.pk} is {report.status}")
    try:
        return default_storage.open(report.file.name, "rb")
    except FileNotFoundError:
        raise ReportNotReady(f"Report {report.pk}'s file is missing") from None
