"""The job ledger: one row per job (the outbox too)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.db.models import Q
from django.utils import timezone

from jobs.core.ownership import OwnedQuerySet
from jobs.core.states import (  # noqa: F401  (re-exported: the models' vocabulary)
    ACTIVE_STATES,
    CLAIMABLE_STATES,
    FINISHED_STATES,
    WAITING_CHILDREN,
    WAITING_STATES,
    DeadLetterStatus,
    JobState,
)
from jobs.models.active import ActiveJob, InActive
from jobs.models.step import JobStep, StepState


def parked_condition(now: datetime | None = None, *, id_field: str = "id") -> Q:
    """A parked job: in a durable sleep or a wait_for() (jobs.worker.steps), its wake-up (a
    wait's timeout) still ahead. The ledger marks it so (jobs.ledger.steps.sleep): its row is
    scheduled for the wake-up and its sleep/wait step is sleeping. Not backlog: it holds no
    worker and waits for its time or its signal; once due (the time came, or the signal moved
    scheduled_for to now) it waits for a worker like any due row. `id_field`: "job_id" over
    ActiveJob rows."""
    sleeping = JobStep.objects.filter(state=StepState.SLEEPING).values("job_id")
    return Q(
        state=JobState.SCHEDULED,
        scheduled_for__gt=now or timezone.now(),
        **{f"{id_field}__in": sleeping},
    )


class JobQuerySet(OwnedQuerySet["Job"]):
    """Jobs; visible_to(user) (OwnedQuerySet) is what the status API and pages may show."""

    def active_where(self, *conditions: Q, **fields: Any) -> JobQuerySet:
        """Active jobs matching conditions on the columns jobs_activejob copies (task_name,
        queue, state, enqueued_at, scheduled_for, published_at, lease_expires_at, crashes):
        found there (jobs.models.active: jobs_job has no index on its state columns, so that
        the workers' UPDATEs are HOT), then read here by primary key, the conditions checked
        again against jobs_job's own row."""
        found = ActiveJob.objects.filter(*conditions, **fields).ids()
        return self.filter(id__active=found).filter(*conditions, **fields)

    def active(self) -> JobQuerySet:
        return self.active_where(state__in=ACTIVE_STATES)

    def finished(self) -> JobQuerySet:
        return self.filter(state__in=FINISHED_STATES)

    def for_task(self, name: str) -> JobQuerySet:
        return self.filter(task_name=name)

    def stopping(self) -> JobQuerySet:
        """Jobs that are cancelled, or running under a cancellation request."""
        return self.filter(Q(state=JobState.CANCELLED) | Q(cancel_requested_at__isnull=False))

    def due(self, now: datetime | None = None) -> JobQuerySet:
        """Scheduled or retrying jobs held in the ledger whose time has come."""
        return self.active_where(
            state__in=(JobState.SCHEDULED, JobState.RETRYING),
            published_at__isnull=True,
            scheduled_for__lte=now or timezone.now(),
        )

    def parked(self, now: datetime | None = None) -> JobQuerySet:
        """Jobs in a durable sleep or a wait_for() whose time has not come (parked_condition)."""
        return self.filter(parked_condition(now))

    def unpublished(self) -> JobQuerySet:
        """Queued jobs whose message has not reached the broker yet (the outbox)."""
        return self.active_where(state=JobState.QUEUED, published_at__isnull=True)


class Job(models.Model):
    """One row per job, written at enqueue in the caller's transaction and moved by workers.

    The row doubles as an outbox: `published_at` is empty until the message reached the broker.
    """

    id = models.UUIDField(
        primary_key=True,
        default=uuid.uuid4,
        editable=False,
        verbose_name="job id",
        help_text="Also the Celery task id.",
    )
    task_name = models.CharField(
        "task", max_length=200, help_text="Registered Celery task name.", db_index=False
    )
    args = models.JSONField("args", default=list, help_text="Positional arguments (JSON).")
    kwargs = models.JSONField("kwargs", default=dict, help_text="Keyword arguments (JSON).")
    queue = models.CharField("queue", max_length=100, help_text="Broker queue it is sent to.")
    priority = models.PositiveSmallIntegerField(
        "priority", default=5, help_text="0 (lowest) to 9 (highest)."
    )
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        verbose_name="owner",
        help_text="User on whose behalf the job runs; only they and staff may read it.",
    )
    idempotency_key = models.CharField(
        "idempotency key",
        max_length=255,
        blank=True,
        default="",
        help_text="Key that de-duplicated this enqueue, if any.",
    )
    state = models.CharField(
        "state",
        max_length=16,
        choices=JobState.choices,
        default=JobState.QUEUED,
        help_text="Where the job is in its life.",
    )
    attempts = models.PositiveIntegerField("attempts", default=0, help_text="Runs started.")
    max_attempts = models.PositiveIntegerField(
        "max attempts", default=1, help_text="Runs allowed by the retry policy."
    )
    deliveries = models.PositiveIntegerField(
        "deliveries", default=0, help_text="Messages received by workers, duplicates included."
    )
    crashes = models.PositiveIntegerField(
        "worker crashes", default=0, help_text="Times a worker process died running it."
    )
    progress_done = models.PositiveBigIntegerField(
        "progress done", default=0, help_text="Steps done."
    )
    progress_total = models.PositiveBigIntegerField(
        "progress total", null=True, blank=True, help_text="Steps in all, when known."
    )
    progress_message = models.CharField(
        "progress message", max_length=255, blank=True, default="", help_text="Latest step."
    )
    error = models.TextField(
        "error",
        blank=True,
        default="",
        help_text="Exception class and message of the last failure.",
    )
    failures = models.JSONField(
        "failures", default=list, blank=True, help_text="One entry per failed attempt."
    )
    parent = models.ForeignKey(
        "self",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="children",
        db_index=False,  # job_parent_idx: partial, over the few rows that have a parent
        verbose_name="parent job",
        help_text="The job that enqueued this one while it ran (a fan-out, a canvas member).",
    )
    cancel_requested_at = models.DateTimeField(
        "cancel requested",
        null=True,
        blank=True,
        help_text="When someone asked the job to stop (it ends cancelled).",
    )
    enqueued_at = models.DateTimeField("enqueued", default=timezone.now, help_text="Accepted.")
    scheduled_for = models.DateTimeField(
        "scheduled for", null=True, blank=True, help_text="Earliest start (delay, eta, retry)."
    )
    published_at = models.DateTimeField(
        "published", null=True, blank=True, help_text="Last handed to the broker; empty = pending."
    )
    started_at = models.DateTimeField(
        "started", null=True, blank=True, help_text="First run started."
    )
    last_started_at = models.DateTimeField(
        "last started", null=True, blank=True, help_text="Latest run started."
    )
    finished_at = models.DateTimeField(
        "finished", null=True, blank=True, help_text="Succeeded or gave up."
    )
    failed_at = models.DateTimeField(
        "failed", null=True, blank=True, help_text="Latest failed attempt."
    )
    lease_expires_at = models.DateTimeField(
        "lease expires", null=True, blank=True, help_text="A running claim is void after this."
    )
    # The claim of the run holding the job (a new uuid per claim): every write of a run, and
    # effect_once, matches it, so a run whose claim another run took over changes nothing.
    lease_owner = models.UUIDField(
        "lease owner",
        null=True,
        blank=True,
        editable=False,
        help_text="Token of the run holding the claim (new at every claim).",
    )
    run_seconds = models.FloatField(
        "run time (s)", null=True, blank=True, help_text="Duration of the last run."
    )
    # The ledger is the job's result store: written by the same UPDATE that finishes the run,
    # so a tracked job costs no extra result-backend row (jobs.worker.results reads it for
    # AsyncResult).
    result = models.JSONField(
        "result",
        null=True,
        blank=True,
        encoder=DjangoJSONEncoder,
        help_text="Return value of the successful run (JSON).",
    )
    publish_options = models.JSONField(
        "publish options",
        default=dict,
        blank=True,
        help_text="Canvas links (chain, chord, group, callbacks) the relay re-sends with the job.",
    )
    # jobs.core.tracing: the W3C context of the span that enqueued the job (empty when not tracing);
    # every message of the job carries it, so a relayed or retried copy stays in its trace.
    trace_context = models.JSONField(
        "trace context",
        default=dict,
        blank=True,
        help_text="OpenTelemetry context it was enqueued in (traceparent names the trace).",
    )
    replay_of = models.ForeignKey(
        "DeadLetter",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="replays",
        verbose_name="replay of",
        help_text="The dead letter this job replays.",
    )

    # jobs.flow.batches: the batch the job is a member of. No foreign-key constraint: a
    # 100,000-member
    # batch is one COPY, and a per-row constraint check would be its largest cost; the batch
    # row is written first, in the same transaction.
    batch = models.ForeignKey(
        "Batch",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="members",
        db_index=False,  # job_batch_idx: partial, over the rows that belong to a batch
        db_constraint=False,
        verbose_name="batch",
        help_text="The batch the job is a member of.",
    )

    objects = JobQuerySet.as_manager()

    class Meta:
        verbose_name = "job"
        verbose_name_plural = "jobs"
        ordering = ("-enqueued_at",)
        # No index reads a column the workers' UPDATEs change (state, published_at,
        # scheduled_for, lease_*, started_at, finished_at, attempts, result...): each would
        # make every claim and finish write a new entry into every index of the table instead
        # of a HOT update. Active jobs are found through jobs_activejob (jobs.models.active);
        # the finished history by its immutable columns (owner, task, enqueued_at: a BRIN index
        # on PostgreSQL, migration 0018, for retention).
        indexes = [
            models.Index(fields=["task_name", "enqueued_at"], name="job_task_idx"),
            # GET /api/jobs/ and the "My jobs" page: a user's jobs newest first, read in index
            # order (keyset pages). Replaces job_owner_idx (owner, enqueued_at), which it covers.
            models.Index(fields=["owner", "-enqueued_at", "-id"], name="job_owner_list_idx"),
            # "My jobs" and GET /api/jobs/?top_level=true: the jobs no job started, read in
            # index order. Without it a user whose campaigns fanned out 100,000 sends had each
            # page scan the table past them (91 ms measured, a Seq Scan); an entry per
            # top-level row only, and parent never changes after the insert.
            models.Index(
                fields=["owner", "-enqueued_at", "-id"],
                name="job_owner_top_idx",
                condition=Q(parent__isnull=True),
            ),
            # A cancel walks the tree a job fanned out; parents never change on the hot path.
            models.Index(
                fields=["parent"], name="job_parent_idx", condition=Q(parent__isnull=False)
            ),
            # A batch's members page and its admin actions (replay dead, cancel pending).
            models.Index(
                fields=["batch", "enqueued_at"],
                name="job_batch_idx",
                condition=Q(batch__isnull=False),
            ),
        ]
        permissions = [
            ("cancel_job", "Can cancel jobs"),
            ("pause_queue", "Can pause and resume queues"),
        ]

    def __str__(self) -> str:
        return f"{self.task_name} {self.id} ({self.state})"

    @property
    def queue_wait(self) -> float | None:
        """Seconds from when the job could first run to when a worker started it."""
        if not self.started_at:
            return None
        ready = max(self.enqueued_at, self.scheduled_for or self.enqueued_at)
        return max(0.0, (self.started_at - ready).total_seconds())

    @property
    def children_cancelled(self) -> bool:
        """It succeeded, and then a cancel stopped the work it had fanned out (a cancel
        requested after it finished: one requested while it ran is earlier than its end)."""
        return (
            self.state == JobState.SUCCEEDED
            and self.cancel_requested_at is not None
            and self.finished_at is not None
            and self.cancel_requested_at > self.finished_at
        )

    def shown_state(self, *, active_children: bool | None = None) -> str:
        """The state a user is shown: a scheduled or retrying job whose time has come is
        queued; a succeeded job whose children have not all ended is `waiting_children` (its
        work goes on: a cancel still reaches it), and one whose children were cancelled that
        way (children_cancelled) is cancelled. One indexed EXISTS for
        a succeeded job, none for the others; none when the caller read `active_children`
        already (a page of jobs counts its children in one query, jobs.web.listing)."""
        state = self.state
        due = self.scheduled_for is not None and self.scheduled_for <= timezone.now()
        if state in (JobState.SCHEDULED, JobState.RETRYING) and due:
            return JobState.QUEUED
        if state == JobState.SUCCEEDED:
            if self.children_cancelled:
                return JobState.CANCELLED
            if active_children is None:
                active_children = Job.objects.filter(
                    parent_id=self.pk, state__in=ACTIVE_STATES
                ).exists()
            if active_children:
                return WAITING_CHILDREN
        return state

    @property
    def progress_percent(self) -> float | None:
        if not self.progress_total:
            return None
        return round(100.0 * self.progress_done / self.progress_total, 1)


# Job.objects.filter(id__active=ActiveJob.objects.filter(...).ids()) (jobs.models.active).
Job._meta.pk.register_lookup(InActive)
