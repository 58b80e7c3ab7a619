"""The active jobs' index: one small row per job that has not ended, kept by the database.

jobs_job holds every job for its retention (millions of rows), and the workers' UPDATEs (claim,
renew, finish) change its state columns. An index on any of those columns makes every such
UPDATE write a new entry into every index of the table (PostgreSQL's HOT updates need the
changed columns to be in no index), and without one the relay's sweeps, /metrics and the
dashboard would scan the whole history. So the columns those readers filter on are copied, for
the active jobs only, into jobs_activejob: a row appears when a job is inserted active and
goes when it ends (or is deleted). The copy is written by triggers on jobs_job (migration
0018; PostgreSQL and SQLite), so every path that writes the ledger — the ledger's own
statements, a COPY, the ORM in a test or the admin — keeps it true in the same statement,
with no round trip of its own.

Readers find active jobs here and then read or update jobs_job by primary key, guarded by
jobs_job's own state (the source of truth): `Job.objects.filter(id__active=...)` below.
"""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.models import Lookup


class ActiveJobQuerySet(models.QuerySet["ActiveJob"]):
    """Active jobs by the columns copied from jobs_job."""

    def ids(self) -> ActiveJobQuerySet:
        return self.values("job_id")  # type: ignore[return-value]  # a values() queryset


class ActiveJob(models.Model):
    """A job that has not ended (queued, scheduled, running, retrying): its state columns."""

    job = models.OneToOneField(
        "jobs.Job",
        primary_key=True,
        on_delete=models.DO_NOTHING,  # the delete trigger removes the row with the job
        db_constraint=False,  # written by triggers, in the job's own statement
        related_name="+",
        verbose_name="job",
        help_text="The active job.",
    )
    task_name = models.CharField("task", max_length=200, help_text="Copied from the job.")
    queue = models.CharField("queue", max_length=100, help_text="Copied from the job.")
    state = models.CharField("state", max_length=16, help_text="Copied from the job.")
    enqueued_at = models.DateTimeField("enqueued", help_text="Copied from the job.")
    scheduled_for = models.DateTimeField(
        "scheduled for", null=True, blank=True, help_text="Copied from the job."
    )
    published_at = models.DateTimeField(
        "published", null=True, blank=True, help_text="Copied from the job."
    )
    lease_expires_at = models.DateTimeField(
        "lease expires", null=True, blank=True, help_text="Copied from the job."
    )
    crashes = models.PositiveIntegerField("worker crashes", default=0, help_text="Copied.")

    objects = ActiveJobQuerySet.as_manager()

    class Meta:
        verbose_name = "active job"
        verbose_name_plural = "active jobs"
        indexes = [
            models.Index(fields=["state", "queue", "enqueued_at"], name="active_state_queue_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.job_id} ({self.state})"


# Not Lookup[Any]: Lookup is generic only in django-stubs, and a host project need not apply
# django_stubs_ext.monkeypatch() (tests/jobs/ledger/test_sqlite.py runs such a host).
class InActive(Lookup):
    """`Job.objects.filter(id__active=ActiveJob.objects.filter(...).ids())`: the jobs whose ids
    the query over jobs_activejob returns, read by primary key.

    On PostgreSQL this is `id = ANY(ARRAY(subquery))`: the subquery runs once and jobs_job is
    read through its primary key. A plain `IN (subquery)` leaves the join order to the
    planner, which picked a sequential scan of 1,000,000 finished rows (270 ms) over 10,000
    primary-key reads (30-50 ms) when the subquery was not selective (measured, issue 26).
    Elsewhere, `IN (subquery)`."""

    lookup_name = "active"

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, list[Any]]:
        lhs, lhs_params = self.process_lhs(compiler, connection)
        rhs, rhs_params = self.process_rhs(compiler, connection)
        if not rhs.startswith("("):
            rhs = f"({rhs})"
        params = [*lhs_params, *rhs_params]
        if connection.vendor == "postgresql":
            return f"{lhs} = ANY(ARRAY{rhs})", params
        return f"{lhs} IN {rhs}", params
