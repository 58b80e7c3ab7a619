"""The daily operations report: declared in code, kept in beat's tables, edited in admin, run."""

from __future__ import annotations

import json
from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.utils import timezone
from django_celery_beat.models import PeriodicTask, PeriodicTasks
from django_celery_beat.schedulers import DatabaseScheduler

from config.celery import app as celery_app
from jobs.models import Job, JobState, JobStep, StepState
from reports.models import Report, ReportKind, ReportOrigin, ReportStatus
from reports.schedules import DAILY_OPERATIONS, schedules_sync
from tests.conftest import wait_until
from tests.reports.conftest import RECIPIENTS, final_job, final_report, pdf_text, squashed

pytestmark = pytest.mark.django_db(transaction=True)

NEW_YORK = ZoneInfo("America/New_York")


def daily() -> PeriodicTask:
    return PeriodicTask.objects.select_related("crontab").get(name=DAILY_OPERATIONS.name)


def next_run(schedule, *, last_run_at: datetime, now: datetime) -> datetime:
    """When beat runs the entry next, seen from the fixed instant `now`."""
    schedule.nowfun = lambda: now.astimezone(schedule.tz)
    return (now + schedule.remaining_estimate(last_run_at)).astimezone(UTC)


def is_due(schedule, *, last_run_at: datetime, now: datetime) -> bool:
    schedule.nowfun = lambda: now.astimezone(schedule.tz)
    return schedule.is_due(last_run_at).is_due


def admin_form_data(page) -> dict[str, str]:
    """What the admin change form would post back unchanged: its fields and inline formsets."""
    assert page.status_code == 200
    form = page.context["adminform"].form
    data = {name: _posted(form[name].value()) for name in form.fields}
    for inline in page.context["inline_admin_formsets"]:
        formset = inline.formset
        data.update(
            {
                formset.management_form.add_prefix(k): _posted(v)
                for k, v in formset.management_form.initial.items()
            }
        )
        for child in formset.forms:
            data.update(
                {child.add_prefix(name): _posted(child[name].value()) for name in child.fields}
            )
    return data


def _posted(value) -> str:
    return "" if value is None else str(value)


def test_migrate_declares_the_daily_report_at_9_new_york():
    task = daily()

    assert task.task == "reports.scheduled" and task.enabled
    assert json.loads(task.kwargs) == {
        "kind": "operations",
        "days": 1,
        "timezone": "America/New_York",
    }
    assert (task.crontab.minute, task.crontab.hour) == ("0", "9")
    assert (task.crontab.day_of_week, task.crontab.day_of_month, task.crontab.month_of_year) == (
        "*",
        "*",
        "*",
    )
    assert str(task.crontab.timezone) == "America/New_York"


def test_sync_creates_only_what_is_missing_and_keeps_operator_edits():
    crontab = daily().crontab
    crontab.hour = "10"
    crontab.save()
    task = daily()
    task.enabled = False
    task.save()

    assert schedules_sync() == []

    task = daily()
    assert task.crontab.hour == "10" and not task.enabled  # the operator's edits stand
    assert PeriodicTask.objects.filter(name=DAILY_OPERATIONS.name).count() == 1

    task.delete()
    assert schedules_sync() == [DAILY_OPERATIONS.name]
    assert daily().crontab.hour == "9"


@pytest.mark.parametrize(
    "last_run_at, now, expected",
    [
        # summer (EDT, UTC-4) and winter (EST, UTC-5)
        (
            datetime(2025, 7, 1, 13, 0, tzinfo=UTC),
            datetime(2025, 7, 1, 15, 0, tzinfo=UTC),
            datetime(2025, 7, 2, 13, 0, tzinfo=UTC),
        ),
        (
            datetime(2025, 1, 15, 14, 0, tzinfo=UTC),
            datetime(2025, 1, 15, 16, 0, tzinfo=UTC),
            datetime(2025, 1, 16, 14, 0, tzinfo=UTC),
        ),
        # spring forward on Sunday 9 March 2025 (02:00 EST -> 03:00 EDT), seen before and after
        (
            datetime(2025, 3, 8, 14, 0, tzinfo=UTC),
            datetime(2025, 3, 8, 20, 0, tzinfo=UTC),
            datetime(2025, 3, 9, 13, 0, tzinfo=UTC),
        ),
        (
            datetime(2025, 3, 8, 14, 0, tzinfo=UTC),
            datetime(2025, 3, 9, 8, 0, tzinfo=UTC),
            datetime(2025, 3, 9, 13, 0, tzinfo=UTC),
        ),
        (
            datetime(2025, 3, 9, 13, 0, tzinfo=UTC),
            datetime(2025, 3, 9, 13, 0, 30, tzinfo=UTC),
            datetime(2025, 3, 10, 13, 0, tzinfo=UTC),
        ),
        # fall back on Sunday 2 November 2025 (02:00 EDT -> 01:00 EST)
        (
            datetime(2025, 11, 1, 13, 0, tzinfo=UTC),
            datetime(2025, 11, 1, 20, 0, tzinfo=UTC),
            datetime(2025, 11, 2, 14, 0, tzinfo=UTC),
        ),
        (
            datetime(2025, 11, 1, 13, 0, tzinfo=UTC),
            datetime(2025, 11, 2, 7, 0, tzinfo=UTC),
            datetime(2025, 11, 2, 14, 0, tzinfo=UTC),
        ),
        (
            datetime(2025, 11, 2, 14, 0, tzinfo=UTC),
            datetime(2025, 11, 2, 14, 0, 30, tzinfo=UTC),
            datetime(2025, 11, 3, 14, 0, tzinfo=UTC),
        ),
    ],
)
def test_next_run_is_9_new_york_on_both_sides_of_dst(last_run_at, now, expected):
    schedule = daily().crontab.schedule

    assert next_run(schedule, last_run_at=last_run_at, now=now) == expected
    assert expected.astimezone(NEW_YORK).hour == 9


def test_is_due_at_13_utc_in_summer_and_14_utc_in_winter():
    schedule = daily().crontab.schedule
    march_8 = datetime(2025, 3, 8, 14, 0, tzinfo=UTC)  # ran 09:00 EST
    november_1 = datetime(2025, 11, 1, 13, 0, tzinfo=UTC)  # ran 09:00 EDT

    assert not is_due(
        schedule, last_run_at=march_8, now=datetime(2025, 3, 9, 12, 59, 30, tzinfo=UTC)
    )
    assert is_due(schedule, last_run_at=march_8, now=datetime(2025, 3, 9, 13, 0, 30, tzinfo=UTC))
    # 13:30 UTC on 2 November is 08:30 EST: not yet
    assert not is_due(
        schedule, last_run_at=november_1, now=datetime(2025, 11, 2, 13, 30, tzinfo=UTC)
    )
    assert is_due(
        schedule, last_run_at=november_1, now=datetime(2025, 11, 2, 14, 0, 30, tzinfo=UTC)
    )


def test_crontab_edited_in_admin_takes_effect_without_restart(admin_client, monkeypatch):
    # given: a running database scheduler that has read the schedule
    monkeypatch.setattr(
        "django_celery_beat.schedulers.aware_now", lambda: datetime(2025, 7, 1, 14, 0, tzinfo=UTC)
    )
    scheduler, watcher = DatabaseScheduler(app=celery_app), DatabaseScheduler(app=celery_app)
    for beat in (scheduler, watcher):
        assert beat.schedule[DAILY_OPERATIONS.name].schedule.hour == {9}
        assert beat.schedule_changed() is False
    before = PeriodicTasks.last_change()
    crontab = daily().crontab

    # when: an operator moves it to 10:00 in admin
    url = f"/admin/django_celery_beat/crontabschedule/{crontab.pk}/change/"
    data = admin_form_data(admin_client.get(url))
    assert data["hour"] == "9"
    response = admin_client.post(url, {**data, "hour": "10", "_save": "Save"})

    # then: the scheduler notices and its entry runs at 10:00 New York (14:00 UTC in summer)
    assert response.status_code == 302, (
        response.context and response.context["adminform"].form.errors
    )
    assert PeriodicTasks.last_change() > before
    assert watcher.schedule_changed() is True
    entry = scheduler.schedule[DAILY_OPERATIONS.name]  # what beat's loop reads on its next tick
    assert entry.schedule.hour == {10}
    assert next_run(
        entry.schedule,
        last_run_at=datetime(2025, 7, 1, 14, 0, tzinfo=UTC),
        now=datetime(2025, 7, 1, 15, 0, tzinfo=UTC),
    ) == datetime(2025, 7, 2, 14, 0, tzinfo=UTC)


@pytest.mark.clock  # yesterday in New York, and its weekday as the PDF prints it
def test_beat_run_makes_renders_and_emails_the_report(rworker, mailbox):
    # given: a finished job yesterday (New York) for the report to count
    yesterday = timezone.now().astimezone(NEW_YORK).date() - timedelta(days=1)
    noon = datetime.combine(yesterday, datetime.min.time().replace(hour=12), NEW_YORK)
    Job.objects.create(
        task_name="shop.invoice",
        queue="default",
        state=JobState.SUCCEEDED,
        attempts=1,
        enqueued_at=noon,
        started_at=noon,
        finished_at=noon,
        run_seconds=1.5,
    )
    celery_app.loader.import_default_modules()  # as `celery beat` does at start: registers the jobs
    scheduler = DatabaseScheduler(app=celery_app)
    entry = scheduler.Entry(daily(), app=celery_app)

    # when: beat sends the entry, the way it does at 09:00
    result = scheduler.apply_async(entry, advance=False)

    # then: the scheduled job made the report, queried its figures, rendered it and emailed it,
    # each a step of that one job
    trigger = final_job(result.id)
    assert trigger.state == JobState.SUCCEEDED and trigger.queue == "reports"
    report = Report.objects.get(trigger_job_id=result.id)
    assert report.origin == ReportOrigin.SCHEDULE and report.kind == ReportKind.OPERATIONS
    assert report.params == {
        "start": str(yesterday),
        "end": str(yesterday),
        "timezone": "America/New_York",
    }
    assert report.email_to == RECIPIENTS.split(",")
    report = final_report(report.pk)
    assert report.status == ReportStatus.READY, report.error

    received = wait_until(
        lambda: len(mailbox.received()) >= 2 and mailbox.received(),
        timeout=60,
        what="the report emails",
    )
    assert sorted(message["To"] for message in received) == sorted(RECIPIENTS.split(","))
    assert str(report.job_id) == result.id and trigger.result == report.pk
    steps = list(JobStep.objects.filter(job_id=result.id).order_by("position"))
    assert [(s.name, s.state, s.attempts) for s in steps] == [
        (name, StepState.SUCCEEDED, 1) for name in ("report", "query", "render", "email")
    ]
    assert steps[0].result == report.pk and steps[3].result == 2  # two emails queued
    assert not Job.objects.filter(parent_id=result.id).exclude(task_name="emails.send").exists()
    for message in received:
        [pdf] = [part for part in message.walk() if part.get_content_type() == "application/pdf"]
        reader, text = pdf_text(pdf.get_payload(decode=True))
        assert len(reader.pages) >= 1 and "Job operations report" in text
        assert squashed(yesterday.strftime("%a %d %b %Y")) in squashed(text)
    report.refresh_from_db()
    assert report.emailed_at is not None


@pytest.mark.clock  # the 7 days before today in New York
def test_a_redelivered_scheduled_run_makes_no_second_report(db):
    from reports import services

    # a run that made its report and died before its step was recorded runs the step again
    trigger = "6f1c2a8e-1111-4a4a-9b9b-123456789abc"

    def make() -> int:
        return services.report_schedule_make(
            kind="operations", days=7, zone="America/New_York", recipients=[],
            trigger_job_id=trigger,
        )  # fmt: skip

    first, again = make(), make()

    assert again == first and Report.objects.count() == 1
    report = Report.objects.get()
    assert str(report.job_id) == trigger and report.status == ReportStatus.QUEUED
    end = date.fromisoformat(report.params["end"])
    assert (end - date.fromisoformat(report.params["start"])).days == 6
    assert not Job.objects.exists()  # the scheduled job itself renders it, in its next steps
