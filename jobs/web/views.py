"""Health and Prometheus metrics endpoints; the job pages (a job's status, "My jobs")."""

from __future__ import annotations

import hmac
import uuid
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import NoReverseMatch, reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_POST
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from jobs.core.conf import backlot_settings
from jobs.core.exceptions import AlreadyFinished
from jobs.core.masking import mask_text
from jobs.core.states import ACTIVE_STATES, WAITING_CHILDREN, JobState
from jobs.enqueue.submit import JobHandle
from jobs.flow.cancellation import cancel
from jobs.flow.deadletters import audit
from jobs.models import Batch, Job
from jobs.web.descriptions import describe, kind_of, kinds
from jobs.web.listing import (
    LISTED_STATES,
    InvalidCursor,
    cursor_for,
    job_documents,
    listed_jobs,
    position,
    step_documents,
)
from jobs.web.metrics import BacklotCollector
from jobs.web.monitoring import health_report

_registry = CollectorRegistry(auto_describe=False)
_registry.register(BacklotCollector())


@never_cache
@require_GET
def health(request: HttpRequest) -> JsonResponse:
    """Status for load balancers and uptime checks; per-check details for staff or the
    metrics token only (they name hosts, workers and queue sizes)."""
    status, details = health_report()
    body: dict = {"status": status}
    if request.user.is_staff or _has_metrics_token(request):
        body.update(details)
    return JsonResponse(body, status=503 if status == "down" else 200)


def _has_metrics_token(request: HttpRequest) -> bool:
    """The request carries `Authorization: Bearer <METRICS_TOKEN>` (never true while unset)."""
    token = backlot_settings().METRICS_TOKEN
    header = request.headers.get("Authorization", "")
    if not token or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header.removeprefix("Bearer ").strip().encode(), token.encode())


@never_cache
@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus text for the METRICS_TOKEN bearer or a staff session. Open to anyone only
    with DEBUG on and no token set (`make run`); system check jobs.W005 warns when the token is
    unset with DEBUG off, where scrapers get 401 (queue names and sizes are not public)."""
    open_for_debug = settings.DEBUG and not backlot_settings().METRICS_TOKEN
    if not (open_for_debug or _has_metrics_token(request) or request.user.is_staff):
        response = HttpResponse(
            "metrics need Authorization: Bearer <METRICS_TOKEN>\n",
            status=401,
            content_type="text/plain",
        )
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return HttpResponse(generate_latest(_registry), content_type=CONTENT_TYPE_LATEST)


@login_required
def job_page(request: HttpRequest, job_id: uuid.UUID) -> HttpResponse:
    """A job's status page: state, attempts and a progress bar polling the status API."""
    job = get_object_or_404(Job.objects.visible_to(request.user), id=job_id)
    status_url = JobHandle(id=str(job.id), task_name=job.task_name).status_url
    # the batch the job is a member of (jobs.flow.batches), when its viewer may read it
    batch = (
        Batch.objects.visible_to(request.user).filter(id=job.batch_id).first()
        if job.batch_id
        else None
    )
    context = {
        "job": job,
        "status_url": status_url,
        "can_cancel": (job.state in ACTIVE_STATES or job.shown_state() == WAITING_CHILDREN)
        and _may_cancel(request.user, job),
        "batch": batch,
        "batch_url": _batch_url(batch) if batch is not None else "",
        "timeline": attempt_timeline(job),
        "steps": step_documents(job),
        # what the job is about, as its app names it (jobs.web.descriptions), as in "My jobs"
        "description": describe([job]).get(job.id),
        "kind": kind_of(job.task_name),
    }
    return render(request, "jobs/job_detail.html", context)


def attempt_timeline(job: Job) -> list[dict[str, Any]]:
    """The job's attempts, oldest first: each failed one from the ledger's `failures` (its
    start and end, the worker, the exception's class and message with emails masked, and the
    delay before the next attempt), then the last one (its start, end and outcome) when it is
    not one of those; a retrying job's entry says when it runs again. (Entries written before
    the start, worker and delay were recorded show a dash there.)"""
    rows: list[dict[str, Any]] = [
        {
            "attempt": entry.get("attempt"),
            "started_at": parse_datetime(str(entry.get("started") or "")),
            "ended_at": parse_datetime(str(entry.get("at") or "")),
            "worker": str(entry.get("worker") or ""),
            "outcome": "failed",
            "error_class": entry.get("exception", ""),
            "error_message": mask_text(str(entry.get("message", ""))),
            "retry_in": entry.get("retry_in"),
            "next_at": None,
        }
        for entry in job.failures or []
    ]
    if rows and job.state == JobState.RETRYING:
        rows[-1]["next_at"] = job.scheduled_for
    failed = {row["attempt"] for row in rows}
    if job.attempts and job.attempts not in failed:
        rows.append(
            {
                "attempt": job.attempts,
                "started_at": job.last_started_at or job.started_at,
                "ended_at": job.finished_at,
                "worker": "",
                "outcome": job.shown_state(),
                "error_class": "",
                "error_message": "",
                "retry_in": None,
                "next_at": None,
            }
        )
    elif rows and job.state == JobState.DEAD:
        rows[-1]["outcome"] = "dead"
    return rows


def _batch_url(batch: Batch) -> str:
    """The batch's status route (GET /api/batches/{id}/), next to the jobs' status route."""
    namespace = backlot_settings().STATUS_URL_NAME.rpartition(":")[0]
    try:
        return reverse(
            f"{namespace}:batch_status" if namespace else "batch_status",
            kwargs={"batch_id": str(batch.id)},
        )
    except NoReverseMatch:  # the host did not mount jobs.web.api_batches.router
        return ""


def _may_cancel(user: Any, job: Job) -> bool:
    """The job's owner, or an operator with the cancel_job permission."""
    return bool(job.owner_id and job.owner_id == user.pk) or user.has_perm("jobs.cancel_job")


@login_required
@require_POST
def job_cancel_page(request: HttpRequest, job_id: uuid.UUID) -> HttpResponse:
    """The job page's Cancel button (audited); back to the job page with what happened."""
    job = get_object_or_404(Job.objects.visible_to(request.user), id=job_id)
    if not _may_cancel(request.user, job):
        raise PermissionDenied("Cancelling another user's job needs the permission jobs.cancel_job")
    try:
        outcome = cancel(job.id, by=request.user)
    except AlreadyFinished as exc:
        messages.warning(request, str(exc))
    else:
        audit(user=request.user, action="cancel-page", count=1, job_id=str(job.id))
        messages.success(
            request,
            "Cancelled." if outcome.state == JobState.CANCELLED else "Asked the job to stop.",
        )
    return redirect("job_page", job_id=job.id)


# The page shows as many jobs as one API page holds by default (GET /api/jobs/).
MY_JOBS_SHOWN = 50
# The "since" filter of "My jobs": a period back from when the page was opened.
SINCE_CHOICES = {
    "1h": ("the last hour", timedelta(hours=1)),
    "24h": ("the last 24 hours", timedelta(days=1)),
    "7d": ("the last 7 days", timedelta(days=7)),
    "30d": ("the last 30 days", timedelta(days=30)),
}
# States in the order a fan-out's counts read ("28 succeeded, 2 queued"): the ones still
# moving first.
STATE_ORDER = (
    JobState.RUNNING,
    JobState.QUEUED,
    JobState.SCHEDULED,
    JobState.RETRYING,
    WAITING_CHILDREN,
    JobState.SUCCEEDED,
    JobState.DEAD,
    JobState.CANCELLED,
)


def children_summary(children: dict[str, Any]) -> list[str]:
    """A fan-out's counts as "My jobs" reads them, one line per kind:
    "Email (30): 28 succeeded, 2 queued" (the page's script writes the same lines)."""
    lines = []
    for kind, states in children["by_kind"].items():
        ordered = sorted(states, key=lambda s: STATE_ORDER.index(s) if s in STATE_ORDER else 99)
        total = sum(states.values())
        lines.append(f"{kind} ({total}): " + ", ".join(f"{states[s]} {s}" for s in ordered))
    return lines


@login_required
def job_list_page(request: HttpRequest) -> HttpResponse:
    """The signed-in user's own jobs as what they did, newest first: each job no other job
    started, named by its app (a campaign, a video: jobs.web.descriptions) with a link to its
    page and to the job's, and under it the jobs it fanned out (a video's renditions listed,
    a campaign's sends counted by state). Filters state, kind and since; pages of
    MY_JOBS_SHOWN over the API's cursor; a script polls GET /api/jobs/ with the same filters
    and cursor every 2 s for live states (the page is complete without it)."""
    state = request.GET.get("state", "")
    state = state if state in LISTED_STATES else ""
    registered = kinds()
    kind = request.GET.get("kind", "")
    kind = kind if kind in registered else ""
    since_key = request.GET.get("since", "")
    since_key = since_key if since_key in SINCE_CHOICES else ""
    since = timezone.now() - SINCE_CHOICES[since_key][1] if since_key else None
    cursor = request.GET.get("cursor", "")
    try:
        after = position(cursor) if cursor else None
    except InvalidCursor:
        messages.warning(request, "That page link is not valid any more: the newest jobs follow.")
        cursor, after = "", None
    jobs = list(
        listed_jobs(
            request.user,
            owner=request.user.pk,  # staff too see their own here; everyone's is in admin
            state=state or None,
            kind=kind or None,
            since=since,
            after=after,
            # a kind's jobs are listed wherever they sit; else a fan-out sits under its parent
            top_level=not kind,
        )[: MY_JOBS_SHOWN + 1]
    )
    more = len(jobs) > MY_JOBS_SHOWN
    documents = job_documents(jobs[:MY_JOBS_SHOWN])
    for document in documents:
        if document["children"] is not None:
            document["children"]["summary"] = children_summary(document["children"])
    filters = {"state": state, "kind": kind, "since": since_key}
    kept = {name: value for name, value in filters.items() if value}
    older = urlencode({**kept, "cursor": cursor_for(jobs[MY_JOBS_SHOWN - 1])}) if more else ""
    # The list route sits next to the status route, in the namespace BACKLOT names for it.
    namespace = backlot_settings().STATUS_URL_NAME.rpartition(":")[0]
    list_url = reverse(f"{namespace}:job_list" if namespace else "job_list")
    polled = {"owner": request.user.pk, "limit": MY_JOBS_SHOWN, "top_level": str(not kind).lower()}
    polled.update({"state": state, "kind": kind} if kept else {})
    polled = {name: value for name, value in polled.items() if value != ""}
    if since is not None:
        polled["since"] = since.isoformat()
    if cursor:
        polled["cursor"] = cursor
    context = {
        "documents": documents,
        "api_url": f"{list_url}?{urlencode(polled)}",
        "filters": filters,
        "filtered": bool(kept),
        "states": LISTED_STATES,
        "kinds": list(registered),
        "since_choices": [(key, label) for key, (label, _) in SINCE_CHOICES.items()],
        "older_url": f"?{older}" if older else "",
        "newest_url": f"?{urlencode(kept)}" if cursor else "",
        # new jobs appear on top only on the first page (a later page is a fixed window)
        "first_page": not cursor,
    }
    return render(request, "jobs/job_list.html", context)
