"""Report schedules declared in code and put into django-celery-beat, where operators edit them.

After every `migrate`, each declared schedule that has no PeriodicTask of its name yet is
created (with its CrontabSchedule in the schedule's own time zone). An existing one is left
exactly as it is: an operator who moved the report to 10:00 in admin keeps 10:00 across
deploys. (CELERY_BEAT_SCHEDULE would not do: beat writes those entries over the database's
on every start.) To stop a schedule, disable its task in admin rather than deleting it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from django.db import transaction

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeclaredSchedule:
    name: str  # PeriodicTask.name, unique: how a declared schedule is recognized
    task: str
    minute: str
    hour: str
    timezone: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    day_of_week: str = "*"
    day_of_month: str = "*"
    month_of_year: str = "*"
    queue: str = "reports"
    description: str = ""

    def crontab_fields(self) -> dict[str, str]:
        return {
            "minute": self.minute,
            "hour": self.hour,
            "day_of_week": self.day_of_week,
            "day_of_month": self.day_of_month,
            "month_of_year": self.month_of_year,
            "timezone": self.timezone,
        }


DAILY_OPERATIONS = DeclaredSchedule(
    name="Daily operations report",
    task="reports.scheduled",
    minute="0",
    hour="9",
    timezone="America/New_York",
    kwargs={"kind": "operations", "days": 1, "timezone": "America/New_York"},
    description=(
        "Every day at 09:00 New York time: the job-operations report of the previous day, "
        "emailed to BACKLOT_REPORT_RECIPIENTS."
    ),
)

SCHEDULES: tuple[DeclaredSchedule, ...] = (DAILY_OPERATIONS,)


def schedules_sync(
    *, using: str = "default", schedules: tuple[DeclaredSchedule, ...] = SCHEDULES
) -> list[str]:
    """Create the PeriodicTask of each declared schedule that has none; returns their names."""
    from django_celery_beat.models import CrontabSchedule, PeriodicTask

    created = []
    with transaction.atomic(using=using):
        for declared in schedules:
            if PeriodicTask.objects.using(using).filter(name=declared.name).exists():
                continue
            crontab, _ = CrontabSchedule.objects.using(using).get_or_create(
                **declared.crontab_fields()
            )
            task = PeriodicTask(
                name=declared.name,
                task=declared.task,
                crontab=crontab,
                kwargs=json.dumps(declared.kwargs),
                queue=declared.queue,
                description=declared.description,
            )
            # save() (not a bulk insert) so that django-celery-beat flags the change to beat.
            task.save(using=using)
            created.append(declared.name)
    for name in created:
        logger.info("Created periodic task %r", name)
    return created


def schedules_sync_after_migrate(
    sender: Any, using: str = "default", apps: Any = None, **kwargs: Any
) -> None:
    """post_migrate receiver: sync once django-celery-beat's tables exist."""
    if apps is not None:
        try:
            apps.get_model("django_celery_beat", "PeriodicTask")
            apps.get_model("django_celery_beat", "CrontabSchedule")
        except LookupError:  # migrating to a state before django-celery-beat's tables
            return
    schedules_sync(using=using)
