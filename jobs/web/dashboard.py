"""The jobs dashboard in admin: per-queue numbers, workers, health, a throughput chart, and a
Pause/Resume button per queue (permission pause_queue, audited).

A queue's jobs are counted once each: waiting (due, not running: the backlog), scheduled (a
delay, an eta, a retry's backoff), parked (in a durable sleep or a wait_for(), their time not
come: no worker held, not backlog; jobs.models.job.parked_condition) and running.

The finished counts (completed and failed in the last hour, the rate per minute, the chart) are
read from Redis's per-minute buckets of finished attempts (jobs.worker.telemetry), not from
jobs_job: the table keeps no index on finished_at (its updates stay HOT), so a count by it
would scan millions of rows. The buckets are kept 2 hours and lost with a Redis flush."""

from __future__ import annotations

from collections import Counter
from typing import Any

from django.contrib import messages
from django.contrib.admin import site
from django.core.exceptions import PermissionDenied
from django.db.models import Count
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.utils.html import format_html

from jobs.broker.pausing import pause, paused_queues, resume
from jobs.core.conf import backlot_settings
from jobs.flow.deadletters import audit
from jobs.models import DeadLetter, JobState
from jobs.web.monitoring import health_report, queue_stats, workers_detail
from jobs.worker.telemetry import finished_by_minute

CHART_MINUTES = 60  # "last hour": the current minute and the 60 whole ones before it
RATE_MINUTES = 5  # throughput_per_minute: succeeded in the 5 whole minutes and this one so far


def dashboard_data() -> dict[str, Any]:
    now = timezone.now()
    dead = dict(
        DeadLetter.objects.unresolved()
        .values("queue")
        .annotate(n=Count("id"))
        .values_list("queue", "n")
    )
    buckets = finished_by_minute(CHART_MINUTES + 1, now=now)
    hour: Counter[tuple[str, str]] = Counter()
    for bucket in buckets:
        hour.update(bucket)
    recent: Counter[str] = Counter()
    for bucket in buckets[-(RATE_MINUTES + 1) :]:
        for (queue, state), n in bucket.items():
            if state == JobState.SUCCEEDED:
                recent[queue] += n
    rate_minutes = RATE_MINUTES + now.second / 60 + now.microsecond / 60_000_000
    queues = []
    paused = paused_queues()
    for q in queue_stats():
        queues.append(
            {
                "name": q.name,
                "state": "paused" if q.name in paused else "active",
                "waiting": q.waiting,
                "scheduled": q.scheduled,
                "parked": q.parked,
                "running": q.running,
                "dead_letters": dead.get(q.name, 0),
                "completed_last_hour": hour[(q.name, JobState.SUCCEEDED)],
                "failed_last_hour": hour[(q.name, JobState.DEAD)],
                "throughput_per_minute": round(recent[q.name] / rate_minutes, 1),
                "oldest_wait_seconds": round(q.oldest_wait_seconds, 1),
            }
        )
    status, details = health_report()
    return {
        "generated_at": now.isoformat(),
        "health": {
            "status": status,
            "problems": details["checks"].get("problems", []),
            "thresholds": {
                "max_queue_depth": backlot_settings().HEALTH_MAX_QUEUE_DEPTH,
                "max_wait_seconds": backlot_settings().HEALTH_MAX_WAIT_SECONDS,
            },
        },
        "queues": queues,
        "workers": workers_detail() if status != "down" else {},
        "chart_svg": throughput_svg(
            [sum(n for (_, state), n in b.items() if state == JobState.SUCCEEDED) for b in buckets]
        ),
    }


def throughput_svg(per_minute: list[int], width: int = 600, height: int = 120) -> str:
    """Jobs succeeded per minute (`per_minute`: the last hour's minutes, oldest first, the
    current one last), as an inline SVG polyline."""
    peak = max(per_minute, default=0) or 1
    step = width / max(len(per_minute) - 1, 1)
    points = " ".join(
        f"{i * step:.1f},{height - 4 - (c / peak) * (height - 20):.1f}"
        for i, c in enumerate(per_minute)
    )
    return format_html(
        '<svg viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" '
        'aria-label="jobs per minute">'
        '<rect width="{w}" height="{h}" fill="#f8fafc" stroke="#dde1e8"/>'
        '<polyline fill="none" stroke="#3451d1" stroke-width="2" points="{p}"/>'
        '<text x="4" y="12" font-size="11" fill="#667085">peak {peak}/min, last 60 min</text>'
        "</svg>",
        w=width,
        h=height,
        p=points,
        peak=max(per_minute, default=0),
    )


def _check(request: HttpRequest) -> None:
    if not request.user.has_perm("jobs.view_job"):
        raise PermissionDenied("You may not view jobs.")


def dashboard_view(request: HttpRequest) -> HttpResponse:
    _check(request)
    if request.method == "POST":
        return _pause_or_resume(request)
    return render(
        request,
        "admin/jobs/dashboard.html",
        {
            **site.each_context(request),
            "title": "Jobs dashboard",
            "data": dashboard_data(),
            "can_pause": request.user.has_perm("jobs.pause_queue"),
        },
    )


def _pause_or_resume(request: HttpRequest) -> HttpResponse:
    """The Pause / Resume button of a queue row (a POST to the dashboard, CSRF-checked)."""
    if not request.user.has_perm("jobs.pause_queue"):
        raise PermissionDenied("You may not pause or resume queues.")
    operation, queue = request.POST.get("operation"), request.POST.get("queue", "")
    if operation not in ("pause", "resume"):
        messages.error(request, "Choose pause or resume.")
        return redirect("admin:jobs_dashboard")
    try:
        changed = (pause if operation == "pause" else resume)(queue, by=request.user)
    except ValueError as exc:
        messages.error(request, str(exc))
        return redirect("admin:jobs_dashboard")
    audit(user=request.user, action=f"{operation}-admin", count=int(changed), queue=queue)
    if operation == "pause":
        text = (
            f"Queue {queue} paused: workers stop taking its jobs within 2 s."
            if changed
            else f"Queue {queue} was paused already."
        )
    else:
        text = f"Queue {queue} resumed." if changed else f"Queue {queue} was not paused."
    messages.success(request, text)
    return redirect("admin:jobs_dashboard")


def dashboard_json(request: HttpRequest) -> JsonResponse:
    _check(request)
    return JsonResponse(dashboard_data())
