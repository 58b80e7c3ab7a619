"""The Report row: what was asked for, by whom, and where its PDF is."""

from __future__ import annotations

import uuid
from collections.abc import Collection

from django.conf import settings
from django.db import models
from django.urls import reverse
from django.utils import timezone

from jobs import OwnedQuerySet


class ReportKind(models.TextChoices):
    """What a report is about; each kind has its parameters, data and template (reports.kinds)."""

    OPERATIONS = (
        "operations",
        "Job operations",
    )  # the job ledger: queues, tasks, outcomes, dead letters
    SALES = "sales", "Sales summary"  # the demo shop: revenue, products, regions, channels


class ReportStatus(models.TextChoices):
    """Where a report is in its life: queued -> rendering -> ready, or -> failed (given up),
    or queued/rendering -> cancelled (its render job was cancelled; nothing is stored).

    A failed report renders again when its job is replayed; a ready one whose PDF is gone too.
    """

    QUEUED = "queued", "Queued"  # accepted; its render job waits for a worker
    RENDERING = "rendering", "Rendering"  # a worker computes the figures and lays out the PDF
    READY = "ready", "Ready"  # the PDF is stored and can be downloaded
    FAILED = "failed", "Failed"  # the render job gave up (see `error`); replaying it renders again
    CANCELLED = "cancelled", "Cancelled"  # its render job was cancelled; no PDF, not emailed


class ReportOrigin(models.TextChoices):
    """Who asked for the report."""

    API = "api", "API"  # POST /api/reports/
    PAGE = "page", "Web page"  # the form on /reports/
    SCHEDULE = "schedule", "Schedule"  # celery beat, through reports.schedules


FINAL_STATUSES = (ReportStatus.READY, ReportStatus.FAILED, ReportStatus.CANCELLED)


class ReportQuerySet(OwnedQuerySet["Report"]):
    """Reports: visible_to(user) and owned_by(user) from jobs.OwnedQuerySet."""

    def ready(self) -> ReportQuerySet:
        return self.filter(status=ReportStatus.READY)


def _move(report: Report, sources: Collection[str], **changes: object) -> bool:
    """Apply `changes` to `report` if its status is still one of `sources`; True if it moved.

    One guarded UPDATE, so a late or duplicate worker cannot move a report backwards; the
    instance follows only when the database did.
    """
    moved = Report.objects.filter(pk=report.pk, status__in=sources).update(**changes)
    if moved:
        for name, value in changes.items():
            setattr(report, name, value)
    return bool(moved)


class Report(models.Model):
    """One requested PDF report; the render job fills in the file and the timings."""

    uid = models.UUIDField(
        "file token",
        default=uuid.uuid4,
        unique=True,
        editable=False,
        help_text="Random id that names the PDF file; never derived from user input.",
    )
    kind = models.CharField(
        "kind", max_length=32, choices=ReportKind.choices, help_text="What the report is about."
    )
    params = models.JSONField(
        "parameters",
        default=dict,
        blank=True,
        help_text="Validated parameters of the kind, e.g. the period (start, end, timezone).",
    )
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="reports",
        verbose_name="owner",
        help_text=(
            "User who asked for it; only they and staff may download it. "
            "Empty for scheduled reports."
        ),
    )
    origin = models.CharField(
        "origin",
        max_length=16,
        choices=ReportOrigin.choices,
        default=ReportOrigin.API,
        help_text="API, web page or schedule.",
    )
    status = models.CharField(
        "status",
        max_length=16,
        choices=ReportStatus.choices,
        default=ReportStatus.QUEUED,
        help_text="Queued, rendering, ready, failed or cancelled.",
    )
    email_to = models.JSONField(
        "email to",
        default=list,
        blank=True,
        help_text="Addresses the PDF is emailed to once ready (empty: not emailed).",
    )
    file = models.FileField(
        "PDF file",
        max_length=255,
        blank=True,
        help_text="Path of the PDF relative to MEDIA_ROOT (reports/YYYY/MM/<file token>.pdf).",
    )
    pages = models.PositiveIntegerField(
        "pages", null=True, blank=True, help_text="Page count of the PDF."
    )
    size_bytes = models.PositiveBigIntegerField(
        "size (bytes)", null=True, blank=True, help_text="Size of the PDF file."
    )
    job_id = models.UUIDField(
        "render job",
        null=True,
        blank=True,
        help_text="Job (ledger id) that renders the PDF; its progress is the report's progress.",
    )
    trigger_job_id = models.UUIDField(
        "scheduled by job",
        null=True,
        blank=True,
        unique=True,
        help_text=(
            "Scheduled job that created the report; unique, so a redelivered run "
            "adds no second report."
        ),
    )
    error = models.TextField(
        "error",
        blank=True,
        default="",
        help_text=(
            "Why rendering gave up, when it failed; on a ready report, why its email step did "
            "not email the PDF."
        ),
    )
    created_at = models.DateTimeField("created", default=timezone.now, help_text="Requested.")
    started_at = models.DateTimeField(
        "started", null=True, blank=True, help_text="A worker started rendering (latest attempt)."
    )
    finished_at = models.DateTimeField(
        "finished", null=True, blank=True, help_text="The PDF was stored, or rendering gave up."
    )
    render_seconds = models.FloatField(
        "render time (s)",
        null=True,
        blank=True,
        help_text="Seconds from loading the figures to the stored PDF.",
    )
    emailed_at = models.DateTimeField(
        "emailed", null=True, blank=True, help_text="The emails with the PDF attached were queued."
    )

    objects = ReportQuerySet.as_manager()

    class Meta:
        verbose_name = "report"
        verbose_name_plural = "reports"
        ordering = ("-created_at", "-id")
        indexes = [
            models.Index(fields=["owner", "created_at"], name="report_owner_idx"),
            models.Index(fields=["status", "created_at"], name="report_status_idx"),
            models.Index(fields=["kind", "created_at"], name="report_kind_idx"),
        ]
        # Who may ask for what (reports.access): a kind's permission, or staff; sending a report
        # to anyone but yourself needs email_report_elsewhere. The scheduler needs neither.
        permissions = [
            ("request_sales_report", "Can request the sales report"),
            ("request_operations_report", "Can request the job operations report"),
            ("email_report_elsewhere", "Can have reports emailed to other addresses"),
        ]

    def __str__(self) -> str:
        return f"{self.get_kind_display()} #{self.pk} ({self.status})"

    # --- derived --------------------------------------------------------------------------
    @property
    def period_label(self) -> str:
        start, end = self.params.get("start"), self.params.get("end")
        if not start or not end:
            return ""
        return start if start == end else f"{start} to {end}"

    @property
    def title(self) -> str:
        label = self.period_label
        return f"{self.get_kind_display()}, {label}" if label else self.get_kind_display()

    @property
    def is_final(self) -> bool:
        return self.status in FINAL_STATUSES

    @property
    def download_url(self) -> str | None:
        if self.status != ReportStatus.READY:
            return None
        return reverse("api-1:report_download", kwargs={"report_id": self.pk})

    @property
    def status_url(self) -> str:
        return reverse("api-1:report_status", kwargs={"report_id": self.pk})

    def download_filename(self) -> str:
        """File name offered to the browser: kind and period, never anything the user typed."""
        start, end = self.params.get("start", ""), self.params.get("end", "")
        period = start if start == end else f"{start}_{end}"
        return f"backlot-{self.kind}-{period or self.pk}.pdf"

    # --- state changes (each a guarded UPDATE "from X to Y"; True if the report moved) -----
    def mark_queued(self, *, job_id: str) -> bool:
        """queued: the render job `job_id` is assigned."""
        return _move(self, [ReportStatus.QUEUED], job_id=job_id)

    def mark_rendering(self, *, job_id: str | None = None) -> bool:
        """queued/rendering/failed/ready -> rendering: a worker starts (again, after a retry or
        a replay, or because a ready report's PDF is gone); `job_id` is the job doing it (a
        replay is a new job)."""
        changes: dict[str, object] = {
            "status": ReportStatus.RENDERING,
            "started_at": timezone.now(),
            "error": "",
        }
        if job_id:
            changes["job_id"] = job_id
        return _move(
            self,
            [ReportStatus.QUEUED, ReportStatus.RENDERING, ReportStatus.FAILED, ReportStatus.READY],
            **changes,
        )

    def mark_ready(
        self, *, file_name: str, pages: int, size_bytes: int, render_seconds: float
    ) -> bool:
        """rendering -> ready: the PDF `file_name` is stored."""
        return _move(
            self,
            [ReportStatus.RENDERING],
            status=ReportStatus.READY,
            file=file_name,
            pages=pages,
            size_bytes=size_bytes,
            render_seconds=render_seconds,
            finished_at=timezone.now(),
            error="",
        )

    def mark_failed(self, *, error: str) -> bool:
        """queued/rendering/failed -> failed: the render job gave up (a ready report stays)."""
        return _move(
            self,
            [ReportStatus.QUEUED, ReportStatus.RENDERING, ReportStatus.FAILED],
            status=ReportStatus.FAILED,
            error=error[:2000],
            finished_at=timezone.now(),
        )

    def mark_cancelled(self) -> bool:
        """queued/rendering -> cancelled: its render job was cancelled (a ready or failed report
        stays as it is)."""
        return _move(
            self,
            [ReportStatus.QUEUED, ReportStatus.RENDERING],
            status=ReportStatus.CANCELLED,
            finished_at=timezone.now(),
        )

    def mark_emailed(self) -> bool:
        """ready: the emails with the PDF attached were queued (an earlier email step's error,
        e.g. before a replay, is cleared)."""
        return _move(self, [ReportStatus.READY], emailed_at=timezone.now(), error="")

    def mark_email_stopped(self, *, error: str) -> bool:
        """ready: its email step was dead-lettered or cancelled; the PDF stays downloadable
        and `error` says why it was not emailed (a replay of the step that succeeds clears it)."""
        return _move(self, [ReportStatus.READY], error=error[:2000])
