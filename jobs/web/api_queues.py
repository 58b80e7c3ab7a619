"""The queues API for staff: GET /api/queues/ (each queue: paused, depth) and
POST /api/queues/{queue}/pause | /resume (permission pause_queue, audited)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.http import HttpRequest
from ninja import Router, Schema
from ninja.errors import HttpError

from jobs.broker.pausing import pause, pause_detail, resume
from jobs.broker.queues import queue_depths
from jobs.core.conf import backlot_settings
from jobs.flow.deadletters import audit

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractUser

router = Router(tags=["queues"])


class AuthenticatedRequest(HttpRequest):
    """For type checking only: the API's auth leaves the user on `auth`."""

    auth: AbstractUser


class QueueOut(Schema):
    name: str
    paused: bool
    depth: int  # messages waiting in Redis (a paused queue keeps growing)
    paused_at: str | None = None
    paused_by: str | None = None


class QueueListOut(Schema):
    queues: list[QueueOut]


def _queue(name: str, depth: int, detail: dict[str, dict[str, Any]]) -> dict[str, Any]:
    paused = detail.get(name)
    return {
        "name": name,
        "paused": paused is not None,
        "depth": depth,
        "paused_at": paused and paused.get("at"),
        "paused_by": paused and paused.get("by"),
    }


def _staff(request: AuthenticatedRequest, *, change: bool = False) -> None:
    if not request.auth.is_staff:
        raise HttpError(403, "Only staff may see or change queues.")
    if change and not request.auth.has_perm("jobs.pause_queue"):
        raise HttpError(403, "You may not pause or resume queues (permission jobs.pause_queue).")


def _one(name: str) -> dict[str, Any]:
    return _queue(name, queue_depths([name])[name], pause_detail())


@router.get("/", response=QueueListOut, url_name="queue_list")
def queue_list(request: AuthenticatedRequest) -> dict[str, Any]:
    """The configured queues, each with whether it is paused and how many messages wait."""
    _staff(request)
    queues = backlot_settings().QUEUES
    depths, detail = queue_depths(queues), pause_detail()
    return {"queues": [_queue(name, depths[name], detail) for name in queues]}


@router.post("/{queue}/pause", response=QueueOut, url_name="queue_pause")
def queue_pause(request: AuthenticatedRequest, queue: str) -> dict[str, Any]:
    """Pause a queue: its jobs are still accepted; workers stop taking them within 2 s.
    Pausing a paused queue changes nothing. 404 for a queue that is not configured."""
    _staff(request, change=True)
    try:
        changed = pause(queue, by=request.auth)
    except ValueError as exc:
        raise HttpError(404, str(exc)) from None
    audit(user=request.auth, action="pause-api", count=int(changed), queue=queue)
    return _one(queue)


@router.post("/{queue}/resume", response=QueueOut, url_name="queue_resume")
def queue_resume(request: AuthenticatedRequest, queue: str) -> dict[str, Any]:
    """Resume a queue: the workers that withheld it consume it again."""
    _staff(request, change=True)
    try:
        changed = resume(queue, by=request.auth)
    except ValueError as exc:
        raise HttpError(404, str(exc)) from None
    audit(user=request.auth, action="resume-api", count=int(changed), queue=queue)
    return _one(queue)
