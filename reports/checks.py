"""System checks: a bad recipient address or schedule fails `manage.py check`, not a 09:00 run."""

from __future__ import annotations

from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from celery.schedules import crontab
from django.core.checks import Error, Tags, register
from django.core.exceptions import ValidationError
from django.core.validators import validate_email

from . import conf
from .schedules import SCHEDULES


@register(Tags.compatibility)
def check_report_recipients(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    problems = []
    for position, address in enumerate(conf.report_recipients(), 1):
        try:
            validate_email(address)
        except ValidationError:
            problems.append(
                Error(
                    f"{conf.RECIPIENTS_VARIABLE} entry {position} is not a valid email address.",
                    hint="Comma-separated addresses, e.g. ops@example.com,cto@example.com.",
                    id="reports.E001",
                )
            )
    return problems


@register(Tags.compatibility)
def check_report_schedules(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    from celery import current_app

    from . import tasks  # noqa: F401  (registers the report jobs with the Celery app)

    problems = []
    for declared in SCHEDULES:
        try:
            ZoneInfo(declared.timezone)
            crontab(
                minute=declared.minute,
                hour=declared.hour,
                day_of_week=declared.day_of_week,
                day_of_month=declared.day_of_month,
                month_of_year=declared.month_of_year,
            )
        except (ZoneInfoNotFoundError, ValueError) as exc:
            problems.append(
                Error(f"Schedule {declared.name!r} is invalid: {exc}", id="reports.E002")
            )
        if declared.task not in current_app.tasks:
            problems.append(
                Error(
                    f"Schedule {declared.name!r} names unknown task {declared.task!r}.",
                    id="reports.E003",
                )
            )
    return problems
