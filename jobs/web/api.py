"""The jobs API: GET /api/jobs/ (the caller's jobs, newest first), GET /api/jobs/{job_id}/, and
a job's cancel and signal routes."""

from __future__ import annotations

import re
import uuid
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.http import HttpRequest
from django.utils.dateparse import parse_datetime
from ninja import Field, Router, Schema
from ninja.errors import HttpError
from ninja.params.functions import Query

from jobs.core.exceptions import AlreadyFinished, InvalidPayload, SignalRefused
from jobs.flow.cancellation import cancel
from jobs.flow.deadletters import audit
from jobs.flow.signals import signal
from jobs.models import Job
from jobs.web.listing import (  # noqa: F401  (listed_jobs, job_status: re-exported)
    CHILDREN_LISTED,
    LISTED_STATES,
    InvalidCursor,
    cursor_for,
    job_documents,
    job_status,
    listed_jobs,
    position,
    step_documents,
)

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser

router = Router(tags=["jobs"])


class AuthenticatedRequest(HttpRequest):
    """For type checking only: a request that passed the API's auth, which leaves the user on
    `auth`. A view still receives Django's own request object."""

    auth: AbstractBaseUser


class JobProgressOut(Schema):
    done: int
    total: int | None
    percent: float | None
    message: str


class JobBaseOut(Schema):
    job_id: str
    task: str
    state: str = Field(
        description="queued, scheduled, running, retrying, waiting_children, succeeded, dead "
        "or cancelled. A scheduled or retrying job whose time has come says queued: it waits "
        "for a worker. waiting_children: it ran and fanned out, and jobs it started have not "
        "ended; cancelling it cancels them (it then says cancelled)."
    )
    queue: str
    priority: int
    progress: JobProgressOut
    result: Any = None
    error: str | None = None
    attempts: int
    max_attempts: int
    enqueued_at: datetime
    scheduled_for: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    queue_wait_seconds: float | None
    run_seconds: float | None
    kind: str = Field(
        "",
        description="What kind of job it is, as its app registered it (jobs.describe_jobs: "
        "Campaign, Video, ...); an unregistered task is its own kind (its task name).",
    )
    label: str = Field(
        "", description="Its domain object as its app names it (a campaign, a video); or empty."
    )
    url: str = Field("", description="The page of that object, or empty.")


class JobChildrenOut(Schema):
    total: int = Field(
        description="Jobs it started: those it enqueued while it ran (a fan-out) and the "
        "callbacks of the batches it opened."
    )
    active: int = Field(description="Of those, the ones that have not ended.")
    by_kind: dict[str, dict[str, int]] = Field(
        description='How many of each kind are in each state, e.g. {"Email": {"succeeded": 28}}.'
    )
    items: list[JobBaseOut] | None = Field(
        description=f"Each of them, oldest first, when they are {CHILDREN_LISTED} or fewer; "
        "else null (a larger fan-out, a campaign's sends, is counted in by_kind)."
    )


class JobStepOut(Schema):
    name: str
    kind: str = Field(description="step, or sleep for a durable sleep.")
    state: str = Field(description="running, succeeded, failed or sleeping.")
    attempts: int = Field(description="How many times the step's function was started.")
    job_attempt: int = Field(description="The job's attempt that last ran it.")
    started_at: datetime
    finished_at: datetime | None
    duration_seconds: float | None
    wake_at: datetime | None = Field(description="A sleep's end: when the job runs again.")
    error: str | None = Field(description="Its last failure: exception class: message.")
    result_bytes: int = Field(description="The size of its stored result, as JSON.")
    copied_from: str | None = Field(
        description="The dead job whose finished step this is (a dead letter's replay)."
    )


class JobOut(JobBaseOut):
    children: JobChildrenOut | None = Field(
        None, description="The jobs it started, or null when it started none."
    )
    steps: list[JobStepOut] | None = Field(
        None,
        description="Its durable steps (self.step, self.sleep), in its code's order, on a "
        "job's own route; null in lists.",
    )


@router.get("/{job_id}/", response=JobOut, url_name="job_status")
def job_detail(request: AuthenticatedRequest, job_id: str) -> dict[str, Any]:
    """A job's state, progress, result or error. Unknown ids and other users' jobs are 404."""
    try:
        key = uuid.UUID(job_id)
    except ValueError:
        raise HttpError(404, "No such job") from None
    job = Job.objects.visible_to(request.auth).filter(id=key).first()
    if job is None:
        raise HttpError(404, "No such job")
    document = job_documents([job])[0]
    document["steps"] = step_documents(job)
    return document


# --- GET /api/jobs/: the caller's jobs ---------------------------------------------------------
LIST_LIMIT = 50
# Enough for a dashboard page, small enough that one request cannot make the API read and
# serialize an unbounded part of the ledger.
LIST_LIMIT_MAX = 200
# An unencoded "+01:00" in a query string arrives as " 01:00"; put the plus sign back.
_SPACED_OFFSET = re.compile(r" (\d{2}:?\d{2})$")


class JobPageOut(Schema):
    items: list[JobOut]
    next_cursor: str | None


def _position(cursor: str) -> tuple[datetime, uuid.UUID]:
    try:
        return position(cursor)
    except InvalidCursor as exc:
        raise HttpError(400, str(exc)) from None


def _since(value: str) -> datetime:
    try:
        parsed = parse_datetime(_SPACED_OFFSET.sub(r"+\1", value.strip()))
    except ValueError:  # well formed but out of range, e.g. month 13
        parsed = None
    if parsed is None or parsed.tzinfo is None:
        raise HttpError(
            400,
            "since must be an ISO 8601 date and time with a time zone, "
            "e.g. 2025-01-31T09:00:00Z or 2025-01-31T09:00:00%2B01:00.",
        )
    return parsed


def _limit(value: str | None) -> int:
    if value is None or value == "":
        return LIST_LIMIT
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if not 1 <= limit <= LIST_LIMIT_MAX:
        raise HttpError(400, f"limit must be a whole number from 1 to {LIST_LIMIT_MAX}.")
    return limit


def _owner(viewer: Any, value: str) -> Any:
    try:
        owner = get_user_model()._meta.pk.to_python(value)
    except ValidationError:
        raise HttpError(400, "owner must be a user id.") from None
    if not getattr(viewer, "is_staff", False) and owner != viewer.pk:
        raise HttpError(403, "Only staff may list other users' jobs (owner=).")
    return owner


@router.get("/", response=JobPageOut, url_name="job_list")
def job_list(
    request: AuthenticatedRequest,
    state: Annotated[
        str | None,
        Query(
            description="Only jobs in this state as the items show it: a scheduled or "
            "retrying job whose time has come is queued, a succeeded one whose children have "
            "not all ended is waiting_children (not succeeded)."
        ),
    ] = None,
    task: Annotated[str | None, Query(description="Only jobs of this task name.")] = None,
    kind: Annotated[
        str | None,
        Query(description="Only jobs of this kind (the items' `kind`: Campaign, Video, ...)."),
    ] = None,
    top_level: Annotated[
        bool,
        Query(
            description="Only jobs no other job started: a fan-out's jobs are then read "
            'in their parent\'s `children` (the "My jobs" page lists so).'
        ),
    ] = False,
    queue: Annotated[str | None, Query(description="Only jobs sent to this queue.")] = None,
    since: Annotated[
        str | None,
        Query(description="Only jobs enqueued at or after this ISO 8601 time (with zone)."),
    ] = None,
    owner: Annotated[
        str | None, Query(description="Staff: only this user's jobs (user id).")
    ] = None,
    cursor: Annotated[str | None, Query(description="next_cursor of the previous page.")] = None,
    limit: Annotated[
        str | None, Query(description=f"Jobs per page, 1-{LIST_LIMIT_MAX} (default {LIST_LIMIT}).")
    ] = None,
) -> dict[str, Any]:
    """The caller's jobs, newest first (staff: everyone's, or one owner's), each item as
    GET /api/jobs/{job_id}/ returns it. Follow next_cursor for the next page; it is null on the
    last one. A bad filter or cursor is a 400 that names it."""
    if state and state not in LISTED_STATES:
        raise HttpError(400, f"Unknown state {state!r}; one of: {', '.join(LISTED_STATES)}.")
    size = _limit(limit)
    jobs = listed_jobs(
        request.auth,
        owner=_owner(request.auth, owner) if owner else None,
        state=state or None,
        task=task or None,
        kind=kind or None,
        queue=queue or None,
        since=_since(since) if since else None,
        after=_position(cursor) if cursor else None,
        top_level=top_level,
    )
    page = list(jobs[: size + 1])
    more = len(page) > size
    page = page[:size]
    return {
        "items": job_documents(page),
        "next_cursor": cursor_for(page[-1]) if more else None,
    }


class CancelOut(Schema):
    job_id: str
    state: str
    cancelled: list[str]
    requested: list[str]


class CancelRefusedOut(Schema):
    detail: str
    state: str


@router.post(
    "/{job_id}/cancel",
    response={202: CancelOut, 409: CancelRefusedOut},
    url_name="job_cancel",
)
def job_cancel(request: AuthenticatedRequest, job_id: str) -> tuple[int, dict[str, Any]]:
    """Cancel a job (and the jobs it fanned out): a waiting one never runs, a running one is
    asked to stop. 202 with what was cancelled; 409 with its state once it has finished; 404
    for unknown ids and other users' jobs (staff may cancel any)."""
    try:
        key = uuid.UUID(job_id)
    except ValueError:
        raise HttpError(404, "No such job") from None
    if not Job.objects.visible_to(request.auth).filter(id=key).exists():
        raise HttpError(404, "No such job")
    try:
        outcome = cancel(key, by=request.auth)
    except AlreadyFinished as exc:
        return 409, {"detail": str(exc), "state": exc.state}
    audit(user=request.auth, action="cancel-api", count=1, job_id=str(key))
    return 202, {
        "job_id": outcome.job_id,
        "state": outcome.state,
        "cancelled": outcome.cancelled,
        "requested": outcome.requested,
    }


# --- POST /api/jobs/{id}/signal: an event for a job's wait_for() -------------------------------


class SignalIn(Schema):
    name: str = Field(
        min_length=1, max_length=190, description="The event, as the job's wait_for() names it."
    )
    payload: Any = Field(None, description="Small JSON: what the job's wait_for() returns.")


class SignalOut(Schema):
    job_id: str
    name: str
    woke: bool = Field(
        description="True: the job was waiting for it and runs again now; false: it is kept "
        "for the job's wait_for() to come."
    )


class SignalRefusedOut(Schema):
    detail: str


@router.post(
    "/{job_id}/signal",
    response={202: SignalOut, 409: SignalRefusedOut},
    url_name="job_signal",
)
def job_signal(
    request: AuthenticatedRequest, job_id: str, body: SignalIn
) -> tuple[int, dict[str, Any]]:
    """Send an event to a job (jobs.signal): a job parked in wait_for(name) resumes with the
    payload; one that has not got there yet finds it when it does. Once per job and name: a
    second signal of the name, or one to a finished job, is 409. 404 for unknown ids and other
    users' jobs (staff may signal any); 400 for a payload that is not small JSON."""
    try:
        key = uuid.UUID(job_id)
    except ValueError:
        raise HttpError(404, "No such job") from None
    if not Job.objects.visible_to(request.auth).filter(id=key).exists():
        raise HttpError(404, "No such job")
    try:
        woke = signal(key, body.name, body.payload)
    except SignalRefused as exc:
        return 409, {"detail": str(exc)}
    except InvalidPayload as exc:
        raise HttpError(400, str(exc)) from None
    except Job.DoesNotExist:
        raise HttpError(404, "No such job") from None
    audit(user=request.auth, action="signal-api", count=1, job_id=str(key), name=body.name)
    return 202, {"job_id": str(key), "name": body.name, "woke": woke}
