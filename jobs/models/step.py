"""A job's durable steps: each step's outcome, kept by job and step name (jobs.worker.steps)."""

from __future__ import annotations

import uuid

from django.db import models
from django.utils import timezone


class StepState(models.TextChoices):
    """Where a step of a job is."""

    RUNNING = "running", "Running"  # started in the job's current (or a lost) run
    SUCCEEDED = "succeeded", "Succeeded"  # finished; its result is kept and never run again
    FAILED = "failed", "Failed"  # raised; the job's retry policy decides whether it runs again
    SLEEPING = "sleeping", "Sleeping"  # a durable sleep: the job is scheduled for `wake_at`


class StepQuerySet(models.QuerySet["JobStep"]):
    def of_job(self, job_id: uuid.UUID | str) -> StepQuerySet:
        """A job's steps in the order its code asked for them."""
        return self.filter(job_id=job_id).order_by("position")

    def finished(self) -> StepQuerySet:
        return self.filter(state=StepState.SUCCEEDED)


class JobStep(models.Model):
    """One step of a job: run once per job and name, its JSON result stored when it succeeds."""

    job = models.ForeignKey(
        "jobs.Job",
        on_delete=models.CASCADE,
        related_name="steps",
        verbose_name="job",
        help_text="The job the step belongs to (removed with it by retention).",
    )
    name = models.CharField("name", max_length=200, help_text="The step's name, unique per job.")
    position = models.PositiveIntegerField(
        "position", help_text="Where the job's code asked for it: 0 for its first step."
    )
    kind = models.CharField(
        "kind", max_length=16, default="step", help_text="'step', or 'sleep' for a durable sleep."
    )
    state = models.CharField(
        "state", max_length=16, choices=StepState.choices, help_text="Where the step is."
    )
    attempts = models.PositiveIntegerField(
        "attempts", default=0, help_text="How many times the step's function was started."
    )
    job_attempt = models.PositiveIntegerField(
        "job attempt", default=0, help_text="The job's attempt that last ran the step."
    )
    started_at = models.DateTimeField(
        "started", default=timezone.now, help_text="When the step last started."
    )
    finished_at = models.DateTimeField(
        "finished", null=True, blank=True, help_text="When it succeeded (a sleep: when it ended)."
    )
    wake_at = models.DateTimeField(
        "wakes", null=True, blank=True, help_text="A sleep's end: when the job runs again."
    )
    error = models.TextField(
        "error", blank=True, default="", help_text="The last failure: exception class: message."
    )
    result = models.JSONField(
        "result", null=True, blank=True, help_text="The step's return value, as JSON."
    )
    result_bytes = models.PositiveIntegerField(
        "result size", default=0, help_text="The stored result's size as JSON, in bytes."
    )
    copied_from = models.UUIDField(
        "copied from",
        null=True,
        blank=True,
        help_text="The job whose finished step this is (a dead letter's replay keeps its steps).",
    )

    objects = StepQuerySet.as_manager()

    class Meta:
        verbose_name = "job step"
        verbose_name_plural = "job steps"
        constraints = [
            models.UniqueConstraint(fields=["job", "name"], name="jobs_step_job_name_uniq"),
        ]
        indexes = [
            models.Index(fields=["job", "position"], name="jobs_step_job_position"),
            # The open sleeps and waits (parked jobs, jobs.models.job.parked_condition), read by
            # the dashboard and every /metrics scrape as one hashed subquery. Without it the
            # subquery scans every step: queue_stats over 100,000 active rows took 332 ms with
            # 600,000 steps (20,000 parked), 148 ms with it, 112 ms counting no parked jobs
            # (2 loaded cores). Step updates are not HOT anyway (rows are inserted densely):
            # 30,000 state updates took no longer with it.
            models.Index(
                fields=["job"],
                name="jobs_step_sleeping_idx",
                condition=models.Q(state="sleeping"),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.job_id}:{self.name}"

    @property
    def duration(self) -> float | None:
        """Seconds from its last start to its finish (None while not finished)."""
        if self.finished_at is None:
            return None
        return (self.finished_at - self.started_at).total_seconds()


class JobSignal(models.Model):
    """An event sent to a job (jobs.signal): kept until the job waits for it (self.wait_for),
    once per job and name: a second signal of the same name is refused."""

    job = models.ForeignKey(
        "jobs.Job",
        on_delete=models.CASCADE,
        related_name="signals",
        verbose_name="job",
        help_text="The job the event is for.",
    )
    name = models.CharField("name", max_length=200, help_text="The event's name.")
    payload = models.JSONField("payload", null=True, blank=True, help_text="The event's data.")
    sent_at = models.DateTimeField("sent", default=timezone.now, help_text="When it was sent.")

    class Meta:
        verbose_name = "job signal"
        verbose_name_plural = "job signals"
        constraints = [
            models.UniqueConstraint(fields=["job", "name"], name="jobs_signal_job_name_uniq"),
        ]

    def __str__(self) -> str:
        return f"{self.job_id}:{self.name}"
