"""The scheduled report is one job of durable steps (report, query, render, email): a layout
retried after it failed, or replayed from its dead letter, does not query the figures again,
and the figures it lays out are the ones the first run stored (real worker, PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from zoneinfo import ZoneInfo

import pytest
from django.db import connection
from django.utils import timezone

from jobs import dead_letter_replay
from jobs.models import DeadLetter, JobState, JobStep, StepState
from reports.models import Report, ReportStatus
from reports.tasks import report_scheduled_job
from tests.conftest import wait_until
from tests.reports.conftest import RECIPIENTS, final_job, final_report, pdf_text, squashed

NEW_YORK = ZoneInfo("America/New_York")

pytestmark = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="the refusal is a PostgreSQL trigger"
)


@contextmanager
def ready_write_refused(times: int, errcode: str) -> Iterator[None]:
    """The first `times` writes that mark a report ready fail in PostgreSQL with SQLSTATE
    `errcode` (serialization_failure: an OperationalError the render policy retries;
    check_violation: an IntegrityError it does not). A sequence counts the refusals."""
    table = connection.ops.quote_name(Report._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute("CREATE SEQUENCE test_ready_refusals")
        cursor.execute(
            "CREATE FUNCTION test_refuse_ready() RETURNS trigger LANGUAGE plpgsql AS $$ "
            f"BEGIN IF nextval('test_ready_refusals') <= {int(times)} THEN "
            f"RAISE EXCEPTION 'test: ready write refused' USING ERRCODE = '{errcode}'; "
            "END IF; RETURN NEW; END $$"
        )
        cursor.execute(
            f"CREATE TRIGGER test_refuse_ready BEFORE UPDATE ON {table} FOR EACH ROW "
            "WHEN (NEW.status = 'ready' AND OLD.status <> 'ready') "
            "EXECUTE FUNCTION test_refuse_ready()"
        )
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP TRIGGER IF EXISTS test_refuse_ready ON {table}")
            cursor.execute("DROP FUNCTION IF EXISTS test_refuse_ready()")
            cursor.execute("DROP SEQUENCE IF EXISTS test_ready_refusals")


def steps_of(job_id: str) -> dict[str, JobStep]:
    return {step.name: step for step in JobStep.objects.filter(job_id=job_id)}


def assert_pdf_of_yesterday(report: Report) -> None:
    """The PDF is the operations report of yesterday in New York, as the beat test reads it."""
    with report.file.open("rb") as pdf:
        _, text = pdf_text(pdf.read())
    yesterday = timezone.now().astimezone(NEW_YORK).date() - timedelta(days=1)
    assert "Job operations report" in text
    assert squashed(yesterday.strftime("%a %d %b %Y")) in squashed(text)


@pytest.mark.clock  # yesterday in New York
def test_a_layout_retried_after_it_failed_does_not_query_again(rworker, mailbox):
    # given a scheduled run whose first "ready" write is refused (a transient error)
    with ready_write_refused(times=1, errcode="40001"):
        handle = report_scheduled_job.enqueue("operations", days=1, timezone="America/New_York")
        job = final_job(handle.id, timeout=90)

    # then the job succeeded on its second attempt, which started at the render step
    assert job.state == JobState.SUCCEEDED and job.attempts == 2
    steps = steps_of(handle.id)
    assert [name for name, _ in sorted(steps.items(), key=lambda kv: kv[1].position)] == [
        "report", "query", "render", "email"
    ]  # fmt: skip
    assert all(step.state == StepState.SUCCEEDED for step in steps.values())
    assert (steps["report"].attempts, steps["report"].job_attempt) == (1, 1)
    assert (steps["query"].attempts, steps["query"].job_attempt) == (1, 1)  # queried once
    assert (steps["render"].attempts, steps["render"].job_attempt) == (2, 2)
    assert (steps["email"].attempts, steps["email"].job_attempt) == (1, 2)
    assert "test: ready write refused" not in steps["render"].error  # cleared by its success

    # and the report, laid out from the stored figures, was emailed once to each recipient
    report = Report.objects.get(pk=job.result or 0)
    assert report.status == ReportStatus.READY and str(report.job_id) == handle.id
    assert_pdf_of_yesterday(report)
    received = wait_until(
        lambda: len(mailbox.received()) >= 2 and mailbox.received(),
        timeout=60,
        what="the report emails",
    )
    assert sorted(m["To"] for m in received) == sorted(RECIPIENTS.split(","))


@pytest.mark.clock
def test_a_scheduled_run_dead_at_render_is_replayed_without_querying_again(rworker, mailbox):
    # given a scheduled run whose layout fails for good (not retried): it is dead-lettered
    with ready_write_refused(times=1, errcode="23514"):
        handle = report_scheduled_job.enqueue("operations", days=1, timezone="America/New_York")
        dead = final_job(handle.id, timeout=90)
    assert dead.state == JobState.DEAD and dead.attempts == 1

    # then its hook (which found the report through jobs.current_job_id()) failed the report
    # it made, with the reason; no second, schedule-level report was written
    report = final_report(steps_of(handle.id)["report"].result or 0)
    assert report.status == ReportStatus.FAILED and Report.objects.count() == 1
    assert report.error.startswith("the scheduled job gave up: IntegrityError: test: ready")
    assert steps_of(handle.id)["render"].state == StepState.FAILED

    # when an operator replays the dead letter
    letter = wait_until(lambda: DeadLetter.objects.filter(job_id=handle.id).first())
    replay = dead_letter_replay(dead_letter=letter)
    job = final_job(replay.id, timeout=90)

    # then the replay got the report and the figures back, and ran only render and email
    assert job.state == JobState.SUCCEEDED and job.result == report.pk
    steps = steps_of(replay.id)
    assert {name: (s.state, s.attempts) for name, s in steps.items()} == {
        "report": (StepState.SUCCEEDED, 1),
        "query": (StepState.SUCCEEDED, 1),
        "render": (StepState.SUCCEEDED, 1),
        "email": (StepState.SUCCEEDED, 1),
    }
    assert steps["query"].copied_from is not None and steps["render"].copied_from is None
    report.refresh_from_db()
    assert report.status == ReportStatus.READY and report.error == ""
    assert str(report.job_id) == replay.id  # status, progress and cancel follow the replay
    assert_pdf_of_yesterday(report)
    received = wait_until(
        lambda: len(mailbox.received()) >= 2 and mailbox.received(),
        timeout=60,
        what="the report emails",
    )
    assert sorted(m["To"] for m in received) == sorted(RECIPIENTS.split(","))
