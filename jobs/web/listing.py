"""A user's jobs as GET /api/jobs/ and the "My jobs" page list them: the filtered, newest-first
keyset pages with their signed cursors, and each job's document with its domain description
(jobs.web.descriptions) and its fan-out (the jobs it started, counted by kind and state).

A page of documents costs a bounded number of queries whatever its length: the page, one
GROUP BY over the children of its jobs (job_parent_idx), one read of the children of the
small fan-outs (a video's renditions), one EXISTS over those children's own children, and one
query per describer; never one per row.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.core import signing
from django.db.models import Count, Exists, F, OuterRef, Q, QuerySet
from django.utils import timezone

from jobs.broker import running
from jobs.core.masking import mask_text
from jobs.core.states import ACTIVE_STATES, WAITING_CHILDREN, WAITING_STATES, JobState
from jobs.models import Job, JobStep
from jobs.web.descriptions import describe, kind_of, tasks_of_kind

# A fan-out of up to this many jobs (a video's renditions and its settling job) is listed job
# by job under its parent; a larger one (a campaign's sends) is counted, by kind and state.
CHILDREN_LISTED = 10
_CURSOR_SALT = "jobs.web.api.job_list.cursor"
# The states a list may be filtered by: the ledger's, and waiting_children (shown_state).
LISTED_STATES = (*JobState.values, WAITING_CHILDREN)


def listed_jobs(
    viewer: Any,
    *,
    owner: Any = None,
    state: str | None = None,
    task: str | None = None,
    kind: str | None = None,
    queue: str | None = None,
    since: datetime | None = None,
    after: tuple[datetime, uuid.UUID] | None = None,
    top_level: bool = False,
) -> QuerySet[Job]:
    """The jobs GET /api/jobs/ lists, newest first by (enqueued_at, id): the viewer's own
    (staff: everyone's, or `owner`'s), strictly after the position `after` when given;
    `top_level`: only jobs no other job started (a fan-out's children are in its document).
    `state` is the state a user is shown (shown_as).

    A user's list (and staff's `owner=`) is served by job_owner_list_idx (owner, enqueued_at
    DESC, id DESC) in the response's order: a page, first or 400th, reads `limit` entries and
    stops (0.1 ms on 100,000 rows); with `top_level`, job_owner_top_idx (the same columns,
    over the rows without a parent) does, however many sends the user's campaigns fanned out
    (0.09 ms past 100,000 of them; a Seq Scan of 91 ms before it). Staff's list of everyone's
    jobs has no index of its own (a scan and top-N sort, 40 ms on 100,000 rows): one on
    (enqueued_at, id) would add an entry to every state change's non-HOT UPDATE, and tempts
    the planner to walk it for an owner's list too, filtering other owners' rows out.
    """
    jobs = Job.objects.visible_to(viewer)
    if owner is not None:
        jobs = jobs.filter(owner=owner)
    if state:
        jobs = jobs.filter(shown_as(state))
    if task:
        jobs = jobs.filter(task_name=task)
    if kind:
        jobs = jobs.filter(task_name__in=tasks_of_kind(kind))
    if queue:
        jobs = jobs.filter(queue=queue)
    if since is not None:
        jobs = jobs.filter(enqueued_at__gte=since)
    if top_level:
        jobs = jobs.filter(parent__isnull=True)
    if after is not None:
        at, key = after
        # `enqueued_at <= at` is what the index scan starts from (an index condition, so a
        # later page does not walk the pages before it); the OR only breaks ties at `at`.
        jobs = jobs.filter(
            Q(enqueued_at__lt=at) | Q(enqueued_at=at, id__lt=key), enqueued_at__lte=at
        )
    return jobs.order_by("-enqueued_at", "-id")


def shown_as(state: str) -> Q:
    """The jobs Job.shown_state shows in `state`: a scheduled or retrying job whose time has
    come is queued; a succeeded one is waiting_children while a job it started is active, and
    cancelled when a cancel stopped its children after it finished (children_cancelled)."""
    now = timezone.now()
    due = Q(state__in=(JobState.SCHEDULED, JobState.RETRYING), scheduled_for__lte=now)
    working = Q(Exists(Job.objects.filter(parent_id=OuterRef("id"), state__in=ACTIVE_STATES)))
    stopped = Q(state=JobState.SUCCEEDED, cancel_requested_at__gt=F("finished_at"))
    if state == JobState.QUEUED:
        return Q(state=JobState.QUEUED) | due
    if state in (JobState.SCHEDULED, JobState.RETRYING):
        return Q(state=state) & ~due
    if state == JobState.CANCELLED:
        return Q(state=JobState.CANCELLED) | stopped
    if state == WAITING_CHILDREN:
        return Q(state=JobState.SUCCEEDED) & ~stopped & working
    if state == JobState.SUCCEEDED:
        return Q(state=JobState.SUCCEEDED) & ~stopped & ~working
    return Q(state=state)


def cursor_for(job: Job) -> str:
    """An opaque, signed position after `job` in the list (tampering makes it invalid)."""
    return signing.dumps([job.enqueued_at.isoformat(), str(job.id)], salt=_CURSOR_SALT)


class InvalidCursor(ValueError):
    """A cursor this list did not issue, or one that was altered."""


def position(cursor: str) -> tuple[datetime, uuid.UUID]:
    """The position a cursor of cursor_for names; InvalidCursor saying why it is not one."""
    try:
        at, key = signing.loads(cursor, salt=_CURSOR_SALT)
        return datetime.fromisoformat(at), uuid.UUID(key)
    except signing.BadSignature:
        raise InvalidCursor(
            "Invalid cursor: it was altered or not issued by this API; "
            "pass next_cursor from the previous page unchanged."
        ) from None
    except (TypeError, ValueError):
        raise InvalidCursor("Invalid cursor: it does not name a position in the list.") from None


def job_status(
    job: Job, *, active_children: bool | None = None, unclaimed: set[str] | None = None
) -> dict[str, Any]:
    """The status document of a job, as the API returns it (and the "My jobs" page polls):
    its state as Job.shown_state says (queued once due, waiting_children, ...), or running
    while a run started without writing its claim (DEFER_CLAIM). `unclaimed`: those runs'
    job ids as jobs.broker.running.unclaimed read them for a page; read for this job if None.
    """
    result = job.result if job.state == JobState.SUCCEEDED else None
    state = job.shown_state(active_children=active_children)
    if state in WAITING_STATES:
        if unclaimed is None:
            unclaimed = running.unclaimed([job])
        if str(job.pk) in unclaimed:
            state = JobState.RUNNING  # its run started; the row is written at its end
    return {
        "job_id": str(job.id),
        "task": job.task_name,
        "state": state,
        "queue": job.queue,
        "priority": job.priority,
        "progress": {
            "done": job.progress_done,
            "total": job.progress_total,
            "percent": job.progress_percent,
            "message": job.progress_message,
        },
        "result": result,
        "error": job.error or None,
        "attempts": job.attempts,
        "max_attempts": job.max_attempts,
        "enqueued_at": job.enqueued_at,
        "scheduled_for": job.scheduled_for,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "queue_wait_seconds": None if job.queue_wait is None else round(job.queue_wait, 3),
        "run_seconds": None if job.run_seconds is None else round(job.run_seconds, 3),
    }


@dataclass
class Family:
    """The jobs one job started: how many, how many have not ended, the count of each kind in
    each state, and, for a fan-out of up to CHILDREN_LISTED, the jobs themselves (oldest first)."""

    total: int = 0
    active: int = 0
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    members: list[Job] | None = None


def families(jobs: Sequence[Job]) -> dict[uuid.UUID, Family]:
    """The fan-out of each of `jobs` (those that started none are left out): one GROUP BY over
    their children, and one read of the children of the small fan-outs."""
    found: dict[uuid.UUID, Family] = defaultdict(Family)
    counts = (
        Job.objects.filter(parent_id__in=[job.id for job in jobs])
        .order_by()
        .values_list("parent_id", "task_name", "state")
        .annotate(n=Count("id"))
    )
    for parent_id, task_name, state, n in counts:
        family = found[parent_id]
        family.total += n
        family.active += n if state in ACTIVE_STATES else 0
        states = family.by_kind.setdefault(kind_of(task_name), {})
        states[state] = states.get(state, 0) + n
    for family in found.values():  # kinds in alphabetical order, on the page and in the API
        family.by_kind = dict(sorted(family.by_kind.items()))
    small = [key for key, family in found.items() if family.total <= CHILDREN_LISTED]
    if small:
        for key in small:
            found[key].members = []
        for child in Job.objects.filter(parent_id__in=small).order_by("enqueued_at", "id"):
            assert child.parent_id is not None  # selected by parent
            members = found[child.parent_id].members
            assert members is not None  # set just above for every small family
            members.append(child)
    return dict(found)


def job_documents(jobs: Sequence[Job]) -> list[dict[str, Any]]:
    """The documents of a page of jobs, in its order: each job's status (job_status), its kind,
    its domain object's label and page (empty when no app describes it), and `children`: its
    fan-out (None when it started no job), whose small fan-outs list each child's document."""
    fans = families(jobs)
    children = [child for family in fans.values() for child in family.members or []]
    busy = set(
        Job.objects.filter(
            parent_id__in=[c.id for c in children if c.state == JobState.SUCCEEDED],
            state__in=ACTIVE_STATES,
        ).values_list("parent_id", flat=True)
        if any(c.state == JobState.SUCCEEDED for c in children)
        else ()
    )
    described = describe([*jobs, *children])
    unclaimed = running.unclaimed([*jobs, *children])

    def document(job: Job, active_children: bool) -> dict[str, Any]:
        doc = job_status(job, active_children=active_children, unclaimed=unclaimed)
        description = described.get(job.id)
        doc["kind"] = kind_of(job.task_name)
        doc["label"] = description.label if description else ""
        doc["url"] = description.url if description else ""
        return doc

    documents = []
    for job in jobs:
        family = fans.get(job.id)
        doc = document(job, active_children=bool(family and family.active))
        doc["children"] = (
            None
            if family is None
            else {
                "total": family.total,
                "active": family.active,
                "by_kind": family.by_kind,
                "items": None
                if family.members is None
                else [document(child, child.id in busy) for child in family.members],
            }
        )
        documents.append(doc)
    return documents


def step_documents(job: Job) -> list[dict[str, Any]]:
    """A job's durable steps (jobs.worker.steps) in the order its code asks for them, as the
    status API and the job page show them: name, kind (step or sleep), state, how often it
    started, the job's attempt that last ran it, start, finish, duration, a sleep's wake-up,
    the last error (emails masked) and the stored result's size; one query."""
    return [
        {
            "name": step.name,
            "kind": step.kind,
            "state": step.state,
            "attempts": step.attempts,
            "job_attempt": step.job_attempt,
            "started_at": step.started_at,
            "finished_at": step.finished_at,
            "duration_seconds": step.duration,
            "wake_at": step.wake_at,
            "error": mask_text(step.error) if step.error else None,
            "result_bytes": step.result_bytes,
            "copied_from": str(step.copied_from) if step.copied_from else None,
        }
        for step in JobStep.objects.of_job(job.id).defer("result")
    ]
