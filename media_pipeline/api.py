"""JSON API of media_pipeline (django-ninja router mounted at /api/videos/ in config/api.py)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from django.urls import reverse
from ninja import Field, P, Router, Schema, Status
from ninja.decorators import decorate_view
from ninja.errors import HttpError
from ninja.files import UploadedFile
from ninja.params import FileEx, FormEx

from config.api_types import AuthenticatedRequest
from web.uploads import upload_limited

from . import services
from .exceptions import InvalidUpload, UploadTooLarge
from .models import RenditionStatus, Video
from .tasks import video_process_job

router = Router(tags=["videos"])

# Videos listed by GET /api/videos/, newest first.
LIST_LIMIT = 100


class FieldErrorOut(Schema):
    loc: list[str | int]
    msg: str
    type: str


class VideoErrorOut(Schema):
    detail: str | list[FieldErrorOut] = Field(
        description="Why: a sentence, or one entry per refused field (the API's parser: a "
        "control character in a form field, a body over its limit)."
    )


class VideoAccepted(Schema):
    video_id: str
    job_id: str
    status_url: str
    job_status_url: str


class VideoProgressOut(Schema):
    percent: float
    done: int
    total: int


class RenditionOut(Schema):
    format: str
    state: str
    progress: int
    width: int | None
    height: int | None
    resolution: str | None
    duration: float | None
    size_bytes: int | None
    error: str | None
    job_id: str | None
    download_url: str | None
    poster_url: str | None = Field(
        description="A JPEG frame of the written file (the player's poster); null until taken."
    )


class VideoOut(Schema):
    video_id: str
    state: str
    name: str
    size_bytes: int
    duration: float | None
    width: int | None
    height: int | None
    error: str | None
    progress: VideoProgressOut
    renditions: list[RenditionOut]
    job_id: str | None
    created_at: datetime
    finished_at: datetime | None


def video_status(video: Video) -> dict[str, Any]:
    """The status document of a video: overall and per-format progress, renditions."""
    renditions = sorted(video.renditions.all(), key=lambda r: services.FORMAT_ORDER.index(r.format))
    percent = video.progress_percent(renditions)
    return {
        "video_id": str(video.id),
        "state": video.status,
        "name": video.original_name,
        "size_bytes": video.source_size,
        "duration": video.duration,
        "width": video.width,
        "height": video.height,
        "error": video.error or None,
        "progress": {"percent": percent, "done": int(percent), "total": 100},
        "renditions": [
            {
                "format": r.format,
                "state": r.status,
                "progress": r.progress,
                "width": r.width,
                "height": r.height,
                "resolution": r.resolution or None,
                "duration": r.duration,
                "size_bytes": r.size_bytes,
                "error": r.error or None,
                "job_id": str(r.job_id) if r.job_id else None,
                "download_url": reverse(
                    "media_pipeline:rendition_download",
                    kwargs={"video_id": video.id, "format": r.format},
                )
                if r.status == RenditionStatus.READY
                else None,
                "poster_url": reverse(
                    "media_pipeline:rendition_poster",
                    kwargs={"video_id": video.id, "format": r.format},
                )
                if r.status == RenditionStatus.READY and r.poster_path
                else None,
            }
            for r in renditions
        ],
        "job_id": str(video.job_id) if video.job_id else None,
        "created_at": video.created_at,
        "finished_at": video.finished_at,
    }


@router.post(
    "/",
    response={202: VideoAccepted, 400: VideoErrorOut, 413: VideoErrorOut},
    url_name="video_create",
)
@decorate_view(upload_limited)
def video_create(
    request: AuthenticatedRequest,
    file: FileEx[UploadedFile, P(description="The video (any container ffmpeg reads).")],
    formats: FormEx[
        list[str] | None,
        P(
            description="360p, 720p and/or 1080p (repeat the field, or comma-separate); "
            "default all."
        ),
    ] = None,
) -> Status[dict[str, Any]]:
    """Upload a video and transcode it to the chosen formats in the background.

    400 names the bad field and 413 refuses a file over BACKLOT_MAX_UPLOAD_BYTES; in both
    cases nothing is stored or enqueued.
    """
    try:
        video, handle = services.video_create(
            owner=request.auth, upload=file, formats=formats, process_job=video_process_job
        )
    except UploadTooLarge as exc:
        raise HttpError(413, str(exc)) from None
    except InvalidUpload as exc:
        raise HttpError(400, str(exc)) from None
    return Status(
        202,
        {
            "video_id": str(video.id),
            "job_id": handle.id,
            "status_url": reverse("api-1:video_status", kwargs={"video_id": str(video.id)}),
            "job_status_url": handle.status_url,
        },
    )


@router.get("/", response=list[VideoOut], url_name="video_list")
def video_list(request: AuthenticatedRequest) -> list[dict[str, Any]]:
    """Your videos, newest first (the latest 100)."""
    videos = Video.objects.owned_by(request.auth).prefetch_related("renditions")[:LIST_LIMIT]
    return [video_status(video) for video in videos]


@router.get("/{video_id}/", response=VideoOut, url_name="video_status")
def video_detail(request: AuthenticatedRequest, video_id: str) -> dict[str, Any]:
    """A video's state, overall and per-format progress, and renditions; others' videos are 404."""
    try:
        key = uuid.UUID(video_id)
    except ValueError:
        raise HttpError(404, "No such video") from None
    video = (
        Video.objects.visible_to(request.auth).prefetch_related("renditions").filter(id=key).first()
    )
    if video is None:
        raise HttpError(404, "No such video")
    return video_status(video)


@router.post(
    "/{video_id}/cancel",
    response={202: VideoOut, 404: VideoErrorOut, 409: VideoErrorOut},
    url_name="video_cancel",
)
def video_cancel(request: AuthenticatedRequest, video_id: str) -> Status[dict[str, Any]]:
    """Cancel a video's processing, as its page's Cancel button does: the jobs still waiting
    or running stop (ffmpeg within seconds, partial files removed), formats written before
    stay; 202 with the video. 409 once everything has finished; others' videos are 404."""
    try:
        key = uuid.UUID(video_id)
    except ValueError:
        raise HttpError(404, "No such video") from None
    video = Video.objects.visible_to(request.auth).filter(id=key).first()
    if video is None:
        raise HttpError(404, "No such video")
    if not services.video_cancel(video=video, by=request.auth):
        return Status(409, {"detail": f"Video {video.id} already finished: it is {video.status}"})
    video.refresh_from_db()
    return Status(202, video_status(video))
