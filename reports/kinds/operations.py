"""The job-operations report: what the job ledger and the dead letters say about a period.

A job belongs to the period in which it finished (succeeded or gave up); that is when its
outcome, attempts and run time are known. The ledger has no index on `finished_at` (every
finish changes it, and an index there would make each finish a non-HOT update: jobs.models.active):
the period's rows are read through what bounds them, `enqueued_at` before the period's end, a
sequential read of the history older than that (0.6 s for 1,000,000 rows here), once a
report.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db.models import Count, F, Q, QuerySet, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from jobs import mask_text
from jobs.models import FINISHED_STATES, DeadLetter, DeadLetterStatus, Job, JobState

from ..charts import (
    FAILED_COLOUR,
    OK_COLOUR,
    bucket_expression,
    bucket_label,
    bucket_size,
    buckets,
    stacked_bars,
)
from ..percentiles import grouped_percentiles
from ..schemas import OperationsParams

SECTIONS = ("summary", "queues", "tasks", "trend", "dead letters")
# Task rows shown; the rest are summed into one "other tasks" line.
MAX_TASK_ROWS = 40
LATEST_DEAD_LETTERS = 10
FRACTIONS = (0.5, 0.95)

_OUTCOMES = {
    "jobs": Count("id"),
    "succeeded": Count("id", filter=Q(state=JobState.SUCCEEDED)),
    "dead": Count("id", filter=Q(state=JobState.DEAD)),
    "retried": Count("id", filter=Q(attempts__gt=1)),
    "retries": Coalesce(Sum(F("attempts") - 1, filter=Q(attempts__gt=1)), 0),
    "crashes": Coalesce(Sum("crashes"), 0),
}


def finished_jobs(params: OperationsParams) -> QuerySet[Job]:
    start, end = params.bounds()
    return Job.objects.filter(
        finished_at__gte=start,
        finished_at__lt=end,
        enqueued_at__lt=end,  # implied by finished_at; job_enqueued_brin can read it
        state__in=FINISHED_STATES,
    ).order_by()


def _with_rates(row: dict[str, Any], timings: tuple[float | None, ...] | None) -> dict[str, Any]:
    jobs = row["jobs"]
    row["success_rate"] = row["succeeded"] / jobs if jobs else None
    row["failure_rate"] = row["dead"] / jobs if jobs else None
    row["p50"], row["p95"] = timings or (None, None)
    return row


def operations_data(params: OperationsParams, on_section: Callable[[str], None]) -> dict[str, Any]:
    """The figures of the operations report; calls on_section(name) after each section."""
    jobs = finished_jobs(params)

    summary = _with_rates(
        jobs.aggregate(**_OUTCOMES),
        grouped_percentiles(jobs, field="run_seconds", fractions=FRACTIONS).get(()),
    )
    summary["recovered"] = jobs.filter(state=JobState.SUCCEEDED, attempts__gt=1).count()
    on_section("summary")

    queue_times = grouped_percentiles(
        jobs, field="run_seconds", fractions=FRACTIONS, group=("queue",)
    )
    queues = [
        _with_rates(row, queue_times.get((row["queue"],)))
        for row in jobs.values("queue").annotate(**_OUTCOMES).order_by("-jobs", "queue")
    ]
    on_section("queues")

    task_times = grouped_percentiles(
        jobs, field="run_seconds", fractions=FRACTIONS, group=("queue", "task_name")
    )
    task_rows = list(
        jobs.values("queue", "task_name").annotate(**_OUTCOMES).order_by("-jobs", "task_name")
    )
    tasks = [
        _with_rates(row, task_times.get((row["queue"], row["task_name"]))) for row in task_rows
    ]
    hidden = tasks[MAX_TASK_ROWS:]
    tasks = tasks[:MAX_TASK_ROWS]
    other_tasks = None
    if hidden:
        other_tasks = _with_rates({key: sum(row[key] for row in hidden) for key in _OUTCOMES}, None)
        other_tasks["count"] = len(hidden)
    on_section("tasks")

    size = bucket_size(params.days)
    per_bucket = {
        row["bucket"]: row
        for row in jobs.annotate(bucket=bucket_expression("finished_at", size, params.zone))
        .values("bucket")
        .annotate(succeeded=_OUTCOMES["succeeded"], dead=_OUTCOMES["dead"])
    }
    trend = stacked_bars(
        [
            (bucket_label(day, size), per_bucket.get(day, {"succeeded": 0, "dead": 0}))
            for day in buckets(params.start, params.end, size, params.zone)
        ],
        series=[("succeeded", OK_COLOUR, "Succeeded"), ("dead", FAILED_COLOUR, "Gave up")],
    )
    on_section("trend")

    start, end = params.bounds()
    letters = DeadLetter.objects.filter(
        last_failed_at__gte=start, last_failed_at__lt=end
    ).order_by()
    letter_counts = letters.aggregate(
        total=Count("id"),
        waiting=Count("id", filter=Q(status=DeadLetterStatus.DEAD)),
        replayed=Count("id", filter=Q(status=DeadLetterStatus.REPLAYED)),
        discarded=Count("id", filter=Q(status=DeadLetterStatus.DISCARDED)),
    )
    letter_groups = list(
        letters.values("task_name", "exception_class")
        .annotate(count=Count("id"), waiting=Count("id", filter=Q(status=DeadLetterStatus.DEAD)))
        .order_by("-count", "task_name")[:15]
    )
    latest = [
        {
            "task_name": letter.task_name,
            "exception_class": letter.exception_class,
            # Messages may quote addresses (a refused recipient): masked, as in the admin list.
            "message": mask_text(letter.exception_message)[:160],
            "attempts": letter.attempts,
            "last_failed_at": letter.last_failed_at,
            "status": letter.get_status_display(),
        }
        for letter in letters.order_by("-last_failed_at")[:LATEST_DEAD_LETTERS]
    ]
    on_section("dead letters")

    return {
        "summary": summary,
        "queues": queues,
        "tasks": tasks,
        "other_tasks": other_tasks,
        "trend": trend,
        "trend_size": size,
        "dead_letters": {"counts": letter_counts, "groups": letter_groups, "latest": latest},
        "unresolved_dead_letters": DeadLetter.objects.unresolved().count(),
        "active_now": Job.objects.active().count(),
        "generated_at": timezone.now(),
    }
