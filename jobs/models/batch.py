"""Batches: a group of jobs followed as one, with counters and exactly-once callbacks.

The counters move in the same transaction as each member's own finishing write
(jobs.ledger.batch), so they cannot drift from the members' states; see jobs.flow.batches.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone

from jobs.core.ownership import OwnedQuerySet
from jobs.core.states import BatchState

# The callbacks a batch may have, in the order they are documented.
CALLBACK_KINDS = ("on_success", "on_complete", "on_death")


class BatchQuerySet(OwnedQuerySet["Batch"]):
    """Batches; visible_to(user) (OwnedQuerySet) is what the batch API may show."""

    def running(self) -> BatchQuerySet:
        return self.filter(state=BatchState.RUNNING)


class Batch(models.Model):
    """A group of jobs (its members) and child batches, with counters and callbacks.

    `pending` counts members that have not ended; a dead member's replay is pending again
    (dead goes down by one), so `total` = pending + succeeded + dead + cancelled always.
    """

    id = models.UUIDField(
        primary_key=True, default=uuid.uuid4, editable=False, verbose_name="batch id"
    )
    description = models.CharField(
        "description", max_length=255, blank=True, default="", help_text="What the batch does."
    )
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        verbose_name="owner",
        help_text="User the batch belongs to; only they and staff may read it.",
    )
    parent = models.ForeignKey(
        "self",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="children",
        verbose_name="parent batch",
        help_text="The batch this one was opened in; it completes only after this one.",
    )
    state = models.CharField(
        "state",
        max_length=16,
        choices=BatchState.choices,
        default=BatchState.RUNNING,
        help_text="running, complete (all ended, not all succeeded) or succeeded.",
    )
    total = models.IntegerField("members", default=0, help_text="Jobs added to the batch.")
    pending = models.IntegerField("pending", default=0, help_text="Members not ended yet.")
    succeeded = models.IntegerField("succeeded", default=0, help_text="Members that succeeded.")
    dead = models.IntegerField(
        "dead", default=0, help_text="Members that gave up (and were not replayed since)."
    )
    cancelled = models.IntegerField("cancelled", default=0, help_text="Members cancelled.")
    children_pending = models.IntegerField(
        "child batches running", default=0, help_text="Child batches not complete yet."
    )
    children_unsucceeded = models.IntegerField(
        "child batches not succeeded", default=0, help_text="Child batches not succeeded yet."
    )
    callbacks = models.JSONField(
        "callbacks",
        default=dict,
        blank=True,
        help_text="on_success / on_complete / on_death: the job each fires, with its arguments.",
    )
    created_at = models.DateTimeField("created", default=timezone.now, help_text="Opened.")
    completed_at = models.DateTimeField(
        "completed", null=True, blank=True, help_text="When every member had ended."
    )
    succeeded_at = models.DateTimeField(
        "succeeded at", null=True, blank=True, help_text="When every member had succeeded."
    )
    died_at = models.DateTimeField(
        "first death", null=True, blank=True, help_text="When a member was first dead-lettered."
    )
    cancel_requested_at = models.DateTimeField(
        "cancel requested",
        null=True,
        blank=True,
        help_text="When someone cancelled the batch's members that had not ended.",
    )

    objects = BatchQuerySet.as_manager()

    class Meta:
        verbose_name = "batch"
        verbose_name_plural = "batches"
        ordering = ("-created_at",)
        indexes = [
            models.Index(fields=["owner", "-created_at"], name="batch_owner_idx"),
            models.Index(fields=["state", "created_at"], name="batch_state_idx"),
        ]

    def __str__(self) -> str:
        return f"batch {self.id} ({self.state})"

    @property
    def ended(self) -> int:
        return self.succeeded + self.dead + self.cancelled

    @property
    def percent(self) -> float | None:
        """Share of members that have ended, or None for an empty batch."""
        if not self.total:
            return None
        return round(100.0 * self.ended / self.total, 1)
