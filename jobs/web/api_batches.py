"""The batches API: GET /api/batches/{batch_id}/ — a batch's counters, state and members."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any

from django.core import signing
from django.db.models import Q, QuerySet
from ninja import Field, Router, Schema
from ninja.errors import HttpError
from ninja.params.functions import Query

from jobs.models import Batch, Job, JobState
from jobs.web.api import AuthenticatedRequest, JobOut, job_status

router = Router(tags=["batches"])

MEMBERS_LIMIT = 50
# As for GET /api/jobs/: one request reads and serializes a bounded part of the ledger.
MEMBERS_LIMIT_MAX = 200
_CURSOR_SALT = "jobs.web.api_batches.members.cursor"


class BatchCountersOut(Schema):
    total: int = Field(description="Jobs added to the batch.")
    pending: int = Field(description="Members not ended yet (a replayed dead member counts).")
    succeeded: int
    dead: int = Field(description="Members dead-lettered and not replayed since.")
    cancelled: int
    children_pending: int = Field(description="Child batches not complete yet.")


class BatchMembersOut(Schema):
    items: list[JobOut]
    next_cursor: str | None


class BatchOut(Schema):
    batch_id: str
    description: str
    state: str = Field(
        description="running; complete (every member ended, some dead or cancelled); or "
        "succeeded (every member and child batch succeeded)."
    )
    counters: BatchCountersOut
    percent: float | None = Field(description="Share of members that ended; null when empty.")
    parent_id: str | None
    children: list[str] = Field(description="Ids of the batches opened inside this one.")
    created_at: datetime
    completed_at: datetime | None
    succeeded_at: datetime | None
    first_death_at: datetime | None
    cancel_requested_at: datetime | None
    members: BatchMembersOut


def batch_status(batch: Batch) -> dict[str, Any]:
    """A batch's status document without its members (the API adds a page of them)."""
    return {
        "batch_id": str(batch.id),
        "description": batch.description,
        "state": batch.state,
        "counters": {
            "total": batch.total,
            "pending": batch.pending,
            "succeeded": batch.succeeded,
            "dead": batch.dead,
            "cancelled": batch.cancelled,
            "children_pending": batch.children_pending,
        },
        "percent": batch.percent,
        "parent_id": str(batch.parent_id) if batch.parent_id else None,
        "children": [
            str(i) for i in Batch.objects.filter(parent=batch).values_list("id", flat=True)[:100]
        ],
        "created_at": batch.created_at,
        "completed_at": batch.completed_at,
        "succeeded_at": batch.succeeded_at,
        "first_death_at": batch.died_at,
        "cancel_requested_at": batch.cancel_requested_at,
    }


def members(
    batch: Batch, *, state: str | None = None, after: tuple[datetime, uuid.UUID] | None = None
) -> QuerySet[Job]:
    """The batch's members in the order they joined (enqueued_at, id), after a position; read
    through job_batch_idx (batch, enqueued_at)."""
    rows = Job.objects.filter(batch=batch)
    if state:
        rows = rows.filter(state=state)
    if after is not None:
        at, key = after
        later = Q(enqueued_at__gt=at) | Q(enqueued_at=at, id__gt=key)
        rows = rows.filter(later, enqueued_at__gte=at)
    return rows.order_by("enqueued_at", "id")


def _cursor(job: Job) -> str:
    return signing.dumps([job.enqueued_at.isoformat(), str(job.id)], salt=_CURSOR_SALT)


def _position(cursor: str) -> tuple[datetime, uuid.UUID]:
    try:
        at, key = signing.loads(cursor, salt=_CURSOR_SALT)
        return datetime.fromisoformat(at), uuid.UUID(key)
    except signing.BadSignature:
        raise HttpError(
            400,
            "Invalid cursor: it was altered or not issued by this API; "
            "pass members.next_cursor from the previous page unchanged.",
        ) from None
    except (TypeError, ValueError):
        raise HttpError(400, "Invalid cursor: it does not name a member.") from None


def _limit(value: str | None) -> int:
    if value is None or value == "":
        return MEMBERS_LIMIT
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MEMBERS_LIMIT_MAX:
        raise HttpError(400, f"limit must be a whole number from 1 to {MEMBERS_LIMIT_MAX}.")
    return limit


@router.get("/{batch_id}/", response=BatchOut, url_name="batch_status")
def batch_detail(
    request: AuthenticatedRequest,
    batch_id: str,
    state: Annotated[str | None, Query(description="Only members in this state.")] = None,
    cursor: Annotated[
        str | None, Query(description="members.next_cursor of the previous page.")
    ] = None,
    limit: Annotated[
        str | None,
        Query(description=f"Members per page, 1-{MEMBERS_LIMIT_MAX} (default {MEMBERS_LIMIT})."),
    ] = None,
) -> dict[str, Any]:
    """A batch's counters, state and members (a page of them, in the order they joined, each
    as GET /api/jobs/{job_id}/ returns it; follow members.next_cursor). The batch's owner and
    staff may read it; unknown ids and other users' batches are 404."""
    try:
        key = uuid.UUID(batch_id)
    except ValueError:
        raise HttpError(404, "No such batch") from None
    batch = Batch.objects.visible_to(request.auth).filter(id=key).first()
    if batch is None:
        raise HttpError(404, "No such batch")
    if state and state not in JobState.values:
        raise HttpError(400, f"Unknown state {state!r}; one of: {', '.join(JobState.values)}.")
    size = _limit(limit)
    page = list(
        members(batch, state=state or None, after=_position(cursor) if cursor else None)[: size + 1]
    )
    more = len(page) > size
    page = page[:size]
    return {
        **batch_status(batch),
        "members": {
            "items": [job_status(job) for job in page],
            "next_cursor": _cursor(page[-1]) if more else None,
        },
    }
