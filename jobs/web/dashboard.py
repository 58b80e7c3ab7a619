"""The jobs dashboard in admin: per-queue numbers, workers, health, a throughput chart, and a
Pause/Resume button per queue (permission pause_queue, audited).

A queue's jobs are counted once each: waiting (due, not running: the backlog), scheduled (a
delay, an eta, a retry's backoff), parked (in a durable sleep or a wait_for(), their time not
come: no worker held, not backlog; jobs.models.job.parked_condition) and running."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib import messages
from django.contrib.admin import site
from django.core.exceptions import PermissionDenied
from django.db.models import Count
from django.db.models.functions import TruncMinute
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.utils.html import format_html

from jobs.broker.pausing import pause, paused_queues, resume
from jobs.core.conf import backlot_settings
from jobs.flow.deadletters import audit
from jobs.models import DeadLetter, Job, JobState
from jobs.web.monitoring import health_report, queue_stats, workers_detail

CHART_MINUTES = 60


def dashboard_data() -> dict[str, Any]:
    now = timezone.now()
    hour_ago = now - timedelta(hours=1)
    dead = dict(
        DeadLetter.objects.unresolved()
        .values("queue")
        .annotate(n=Count("id"))
        .values_list("queue", "n")
    )
    finished = {
        (row["queue"], row["state"]): row["n"]
        for row in Job.objects.filter(finished_at__gte=hour_ago)
        .values("queue", "state")
        .annotate(n=Count("id"))
    }
    recent = {
        row["queue"]: row["n"]
        for row in Job.objects.filter(
            finished_at__gte=now - timedelta(minutes=5), state=JobState.SUCCEEDED
        )
        .values("queue")
        .annotate(n=Count("id"))
    }
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
                "completed_last_hour": finished.get((q.name, JobState.SUCCEEDED), 0),
                "failed_last_hour": finished.get((q.name, JobState.DEAD), 0),
                "throughput_per_minute": round(recent.get(q.name, 0) / 5, 1),
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
        "chart_svg": throughput_svg(now),
    }


def throughput_svg(now: Any, width: int = 600, height: int = 120) -> str:
    """Jobs finished per minute over the last hour, as an inline SVG polyline."""
    start = (now - timedelta(minutes=CHART_MINUTES)).replace(second=0, microsecond=0)
    per_minute = dict(
        Job.objects.filter(finished_at__gte=start, state=JobState.SUCCEEDED)
        .annotate(minute=TruncMinute("finished_at"))
        .values("minute")
        .annotate(n=Count("id"))
        .values_list("minute", "n")
    )
    counts = [per_minute.get(start + timedelta(minutes=i), 0) for i in range(CHART_MINUTES + 1)]
    peak = max(counts) or 1
    step = width / CHART_MINUTES
    points = " ".join(
        f"{i * step:.1f},{height - 4 - (c / peak) * (height - 20):.1f}"
        for i, c in enumerate(counts)
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
        peak=max(counts),
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
