"""Schedule fires: one row per (schedule, fire time) beat fired, so that no time fires twice."""

from __future__ import annotations

from datetime import datetime

from django.db import models
from django.db.models import Exists, Max, OuterRef
from django.utils import timezone


class ScheduleFireQuerySet(models.QuerySet["ScheduleFire"]):
    def for_schedule(self, name: str) -> ScheduleFireQuerySet:
        return self.filter(schedule=name)

    def last_fire_at(self, name: str) -> datetime | None:
        """The latest fire time recorded for the schedule `name` (None: never fired)."""
        return (
            self.for_schedule(name).order_by("-fire_at").values_list("fire_at", flat=True).first()
        )

    def last_fires(self, names: list[str]) -> dict[str, datetime]:
        """The latest fire time of each schedule in `names` that has fired."""
        rows = self.filter(schedule__in=names).values("schedule").annotate(last=Max("fire_at"))
        return {row["schedule"]: row["last"] for row in rows}

    def prunable(self, before: datetime) -> ScheduleFireQuerySet:
        """Fires older than `before` that a later fire of their schedule supersedes: the last
        fire of each schedule is kept however old, it is where the next one counts from."""
        later = ScheduleFire.objects.filter(
            schedule=OuterRef("schedule"), fire_at__gt=OuterRef("fire_at")
        )
        return self.filter(fire_at__lt=before).filter(Exists(later))


class ScheduleFire(models.Model):
    """A fire time of a periodic task that beat fired (written with the job, before its
    message is sent; a second beat's insert of the same time fails on the unique pair)."""

    schedule = models.CharField(
        "schedule",
        max_length=200,
        help_text="The periodic task's name (django-celery-beat's PeriodicTask.name).",
    )
    fire_at = models.DateTimeField(
        "fire time",
        help_text="The time the schedule named (for a crontab: in its time zone, stored in UTC).",
    )
    fired_at = models.DateTimeField(
        "fired at", default=timezone.now, help_text="When beat fired it (late: a catch-up)."
    )
    job_id = models.UUIDField(
        "job id",
        null=True,
        blank=True,
        help_text="The job it fired: its ledger row, or the message id of a plain Celery task.",
    )
    beat = models.CharField(
        "beat", max_length=200, blank=True, help_text="The beat that fired it (host:pid:id)."
    )

    objects = ScheduleFireQuerySet.as_manager()

    class Meta:
        verbose_name = "schedule fire"
        verbose_name_plural = "schedule fires"
        ordering = ["-fire_at"]
        constraints = [
            models.UniqueConstraint(fields=["schedule", "fire_at"], name="jobs_schedule_fire_once")
        ]

    def __str__(self) -> str:
        return f"{self.schedule} @ {self.fire_at:%Y-%m-%d %H:%M:%S%z}"
