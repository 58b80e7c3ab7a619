"""Dead letters (what an operator inspects, replays or discards) and the audit of operator
actions."""

from __future__ import annotations

import uuid
from typing import Any

from django.conf import settings
from django.db import models
from django.utils import timezone

from jobs.core.states import (  # noqa: F401  (re-exported: the models' vocabulary)
    ACTIVE_STATES,
    CLAIMABLE_STATES,
    FINISHED_STATES,
    WAITING_STATES,
    DeadLetterStatus,
    JobState,
)
from jobs.models.job import Job

# Filters operators may pass to bulk actions (admin "replay all matching", `manage.py jobs`).
DEAD_LETTER_FILTERS = {
    "status": "status",
    "task": "task_name",
    "exception": "exception_class",
    "queue": "queue",
    "since": "last_failed_at__gte",
    "until": "last_failed_at__lt",
    "search": None,  # job id, or text in the exception message
}


class DeadLetterQuerySet(models.QuerySet["DeadLetter"]):
    def unresolved(self) -> DeadLetterQuerySet:
        return self.filter(status=DeadLetterStatus.DEAD)

    def for_task(self, name: str) -> DeadLetterQuerySet:
        return self.filter(task_name=name)

    def matching(self, filters: dict[str, Any]) -> DeadLetterQuerySet:
        """Rows matching operator filters (keys of DEAD_LETTER_FILTERS); unknown keys raise."""
        queryset = self
        for key, value in filters.items():
            if value in (None, ""):
                continue
            if key not in DEAD_LETTER_FILTERS:
                raise ValueError(f"Unknown dead-letter filter {key!r}")
            lookup = DEAD_LETTER_FILTERS[key]
            if lookup is None:  # "search"
                try:
                    queryset = queryset.filter(job_id_value=uuid.UUID(str(value)))
                except ValueError:
                    queryset = queryset.filter(exception_message__icontains=value)
            else:
                queryset = queryset.filter(**{lookup: value})
        return queryset


class DeadLetter(models.Model):
    """A job that gave up, with everything needed to understand and replay it."""

    job = models.OneToOneField(
        Job,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="dead_letter",
        verbose_name="job",
        help_text="Ledger entry of the job that gave up (empty for untracked jobs).",
    )
    job_id_value = models.UUIDField(
        "job id", db_index=True, help_text="Celery task id of the job that gave up."
    )
    task_name = models.CharField("task", max_length=200, help_text="Registered task name.")
    args = models.JSONField("args", default=list, help_text="Positional arguments (JSON).")
    kwargs = models.JSONField("kwargs", default=dict, help_text="Keyword arguments (JSON).")
    queue = models.CharField("queue", max_length=100, help_text="Queue it ran on.")
    priority = models.PositiveSmallIntegerField("priority", default=5, help_text="0-9.")
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        verbose_name="owner",
        help_text="Owner of the job.",
    )
    attempts = models.PositiveIntegerField("attempts", default=0, help_text="Runs made.")
    exception_class = models.CharField(
        "exception", max_length=255, help_text="Dotted class of the final exception."
    )
    exception_message = models.TextField("message", blank=True, help_text="Its message.")
    traceback = models.TextField("traceback", blank=True, help_text="Full traceback.")
    first_failed_at = models.DateTimeField("first failure", help_text="First failed attempt.")
    last_failed_at = models.DateTimeField("last failure", help_text="Final failed attempt.")
    status = models.CharField(
        "status",
        max_length=16,
        choices=DeadLetterStatus.choices,
        default=DeadLetterStatus.DEAD,
        help_text="Dead, replayed or discarded.",
    )
    replayed_job = models.ForeignKey(
        Job,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        verbose_name="replayed as",
        help_text="The new job a replay created.",
    )
    resolved_at = models.DateTimeField(
        "resolved", null=True, blank=True, help_text="When it was replayed or discarded."
    )
    resolved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        verbose_name="resolved by",
        help_text="Operator who replayed or discarded it.",
    )

    objects = DeadLetterQuerySet.as_manager()

    class Meta:
        verbose_name = "dead letter"
        verbose_name_plural = "dead letters"
        ordering = ("-last_failed_at",)
        permissions = [
            ("replay_deadletter", "Can replay dead letters"),
            ("discard_deadletter", "Can discard dead letters"),
            ("view_raw_arguments", "Can view raw (unmasked) job arguments"),
        ]
        indexes = [
            models.Index(fields=["status", "last_failed_at"], name="dl_status_idx"),
            models.Index(fields=["task_name", "last_failed_at"], name="dl_task_idx"),
            models.Index(fields=["last_failed_at"], name="dl_failed_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.task_name} {self.job_id_value} ({self.status})"


class AuditEntry(models.Model):
    """An operator action on jobs or dead letters: who, what, how many, when."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        verbose_name="user",
        help_text="Operator who acted.",
    )
    action = models.CharField(
        "action", max_length=50, help_text="replay, discard, replay-edited, …"
    )
    count = models.PositiveIntegerField("count", default=0, help_text="Rows affected.")
    detail = models.JSONField("detail", default=dict, blank=True, help_text="Filters, ids, edits.")
    created_at = models.DateTimeField("when", default=timezone.now, help_text="When it happened.")

    class Meta:
        verbose_name = "audit entry"
        verbose_name_plural = "audit entries"
        ordering = ("-created_at",)
        indexes = [models.Index(fields=["created_at"], name="audit_created_idx")]

    def __str__(self) -> str:
        return f"{self.action} x{self.count} by {self.user}"
