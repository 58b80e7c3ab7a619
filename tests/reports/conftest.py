"""Fixtures of the reports tests: their own worker on `reports` (and `emails`), users, helpers."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from pypdf import PdfReader

from jobs.models import Job, JobState
from reports.models import FINAL_STATUSES, Report
from tests.conftest import Worker, wait_until

RECIPIENTS = "ops@example.com,cto@example.com"


@pytest.fixture(scope="package")
def reports_worker(start_worker: Callable[..., Worker]) -> Iterator[Worker]:
    """The session worker leaves `reports` alone; this one takes it (and `emails`: the chain)
    while tests/reports run, and stops after them: later tests count on nothing consuming
    `reports` but their own workers."""
    worker = start_worker(
        "reports", queues="reports,emails", concurrency=2, BACKLOT_REPORT_RECIPIENTS=RECIPIENTS
    )
    yield worker
    worker.stop()


@pytest.fixture
def rworker(reports_worker: Worker, clean_redis: None, transactional_db: None) -> Iterator[Worker]:
    """A running reports worker, an empty broker, committed data; PDFs removed afterwards."""
    yield reports_worker
    remove_report_files()


def remove_report_files() -> None:
    root = Path(settings.MEDIA_ROOT)
    for name in Report.objects.exclude(file="").values_list("file", flat=True):
        (root / name).unlink(missing_ok=True)


REQUEST_BOTH_KINDS = ("request_sales_report", "request_operations_report")


def grant(user: Any, *codenames: str) -> Any:
    """`user` with the reports permissions `codenames`, read afresh (no stale permission cache)."""
    user.user_permissions.add(
        *Permission.objects.filter(content_type__app_label="reports", codename__in=codenames)
    )
    return type(user).objects.get(pk=user.pk)


@pytest.fixture
def owner(django_user_model: Any) -> Any:
    """A requester who may ask for both kinds (reports.access), emailed only to themselves."""
    user = django_user_model.objects.create_user(
        "report-owner", email="owner@example.com", password="pw-owner-123"
    )
    return grant(user, *REQUEST_BOTH_KINDS)


@pytest.fixture
def stranger(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("report-stranger", password="pw-stranger-123")


@pytest.fixture
def staff(django_user_model: Any) -> Any:
    return get_user_model().objects.create_user(
        "report-staff", password="pw-staff-123", is_staff=True
    )


def post_report(client: Any, **payload: Any) -> Any:
    return client.post("/api/reports/", payload, content_type="application/json")


def final_report(report_id: int, timeout: float = 90) -> Report:
    return wait_until(
        lambda: Report.objects.filter(pk=report_id, status__in=FINAL_STATUSES).first(),
        timeout=timeout,
        interval=0.1,
        what=f"report {report_id} to finish",
    )


def final_job(job_id: str, timeout: float = 60) -> Job:
    return wait_until(
        lambda: Job.objects.filter(
            id=job_id, state__in=[JobState.SUCCEEDED, JobState.DEAD]
        ).first(),
        timeout=timeout,
        interval=0.1,
        what=f"job {job_id} to finish",
    )


def pdf_text(data: bytes) -> tuple[PdfReader, str]:
    reader = PdfReader(io.BytesIO(data))
    return reader, "\n".join(page.extract_text() or "" for page in reader.pages)


def squashed(text: str) -> str:
    """text without its whitespace: pypdf splits kerned glyph pairs ("Tue" reads "T ue"), so a
    phrase is compared with the extracted text both squashed."""
    return "".join(text.split())


def pdf_title(reader: PdfReader) -> str:
    """The title in the PDF's metadata ("" when it has none)."""
    return (reader.metadata.title if reader.metadata else None) or ""


def downloaded(response: Any) -> bytes:
    return b"".join(response.streaming_content)
