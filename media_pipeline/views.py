"""Pages of media_pipeline: upload and list videos, watch one transcode, fetch a rendition or
its poster frame."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import (
    FileResponse,
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    StreamingHttpResponse,
)
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils.cache import patch_cache_control
from django.utils.http import content_disposition_header
from django.views.decorators.csrf import csrf_exempt, csrf_protect
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from web.uploads import UploadCheck, limit_upload, upload_limit_message

from . import services
from .exceptions import InvalidUpload, UploadTooLarge
from .forms import VideoUploadForm
from .models import Rendition, RenditionStatus, Video
from .tasks import video_process_job

# Videos shown on the list page, newest first.
LIST_LIMIT = 50
# Bytes per read when streaming a byte range of a rendition.
RANGE_CHUNK = 64 * 1024


@csrf_exempt  # CSRF is checked by _video_list, after the upload limit is installed
@login_required
@require_http_methods(["GET", "POST"])
def video_list(request: HttpRequest) -> HttpResponse:
    """The user's videos and the upload form.

    Upload handlers must be set before anything reads request.POST, and the CSRF check reads
    it: so the limit goes first, then the CSRF check (Django's documented pattern).
    """
    check = limit_upload(request) if request.method == "POST" else None
    if check is not None and check.refused_unread:
        return _render_list(request, VideoUploadForm(), status=413, error=_limit_message(check))
    return _video_list(request, check)


@csrf_protect
def _video_list(request: HttpRequest, check: UploadCheck | None) -> HttpResponse:
    if check is None:
        return _render_list(request, VideoUploadForm())
    form = VideoUploadForm(request.POST, request.FILES)  # reads the body, under the limit
    if check.too_large:
        return _render_list(request, VideoUploadForm(), status=413, error=_limit_message(check))
    if not form.is_valid():
        return _render_list(request, form, status=400)
    try:
        video, _ = services.video_create(
            owner=request.user,
            upload=form.cleaned_data["file"],
            formats=form.cleaned_data["formats"],
            process_job=video_process_job,
        )
    except InvalidUpload as exc:
        form.add_error(exc.field if exc.field in form.fields else None, str(exc))
        return _render_list(request, form, status=413 if isinstance(exc, UploadTooLarge) else 400)
    messages.success(
        request, f"{video.original_name or 'Your video'} is uploaded; transcoding starts now."
    )
    return redirect("media_pipeline:video_detail", video_id=video.id)


def _limit_message(check: UploadCheck) -> str:
    size = check.declared if check.refused_unread else None
    return upload_limit_message(size=size, limit=check.limit)


def _render_list(
    request: HttpRequest, form: VideoUploadForm, *, status: int = 200, error: str = ""
) -> HttpResponse:
    videos = Video.objects.owned_by(request.user).prefetch_related("renditions")[:LIST_LIMIT]
    context = {
        "form": form,
        "videos": videos,
        "error": error,
        "max_bytes": settings.BACKLOT_MAX_UPLOAD_BYTES,
    }
    return render(request, "media_pipeline/video_list.html", context, status=status)


@login_required
@require_GET
def video_detail(request: HttpRequest, video_id: uuid.UUID) -> HttpResponse:
    """A video's state and per-format progress bars, polling the status API until it settles."""
    video = get_object_or_404(Video.objects.visible_to(request.user), pk=video_id)
    renditions = sorted(video.renditions.all(), key=lambda r: services.FORMAT_ORDER.index(r.format))
    context = {
        "video": video,
        "renditions": renditions,
        "percent": video.progress_percent(renditions),
        "status_url": reverse("api-1:video_status", kwargs={"video_id": str(video.id)}),
    }
    return render(request, "media_pipeline/video_detail.html", context)


@login_required
@require_POST
def video_cancel(request: HttpRequest, video_id: uuid.UUID) -> HttpResponse:
    """The Cancel button of a video being processed (its owner or staff): its jobs are
    cancelled, ffmpeg is stopped, formats written before stay."""
    video = get_object_or_404(Video.objects.visible_to(request.user), pk=video_id)
    if services.video_cancel(video=video, by=request.user):
        messages.success(request, "Cancelled: no further formats are transcoded.")
    else:
        messages.info(request, f"The video already finished: it is {video.status}.")
    return redirect("media_pipeline:video_detail", video_id=video.id)


@login_required
@require_GET
def rendition_download(request: HttpRequest, video_id: uuid.UUID, format: str) -> HttpResponseBase:
    """A written rendition, for its owner or staff; byte ranges let a player seek.

    Served by Django rather than from a public MEDIA_URL, so the owner check holds. Add
    ?download=1 to save it instead of playing it.
    """
    video = get_object_or_404(Video.objects.visible_to(request.user), pk=video_id)
    rendition = get_object_or_404(
        Rendition, video=video, format=format, status=RenditionStatus.READY
    )
    path = services.media_path(rendition.path)
    if not path.is_file():
        raise Http404("The rendition's file is missing")
    stem = PurePosixPath(video.original_name).stem or "video"
    filename = f"{stem}-{rendition.format}.mp4"
    response = _file_response(
        request, path, filename, as_attachment=bool(request.GET.get("download"))
    )
    patch_cache_control(response, private=True, max_age=3600)
    return response


@login_required
@require_GET
def rendition_poster(request: HttpRequest, video_id: uuid.UUID, format: str) -> HttpResponseBase:
    """A written rendition's poster frame (JPEG), for its owner or staff."""
    video = get_object_or_404(Video.objects.visible_to(request.user), pk=video_id)
    rendition = get_object_or_404(
        Rendition.objects.exclude(poster_path=""),
        video=video,
        format=format,
        status=RenditionStatus.READY,
    )
    path = services.media_path(rendition.poster_path)
    if not path.is_file():
        raise Http404("The poster's file is missing")
    response = FileResponse(path.open("rb"), content_type="image/jpeg")
    patch_cache_control(response, private=True, max_age=3600)
    return response


def _file_response(
    request: HttpRequest, path: Path, filename: str, *, as_attachment: bool
) -> HttpResponseBase:
    size = path.stat().st_size
    wanted = re.fullmatch(r"bytes=(\d*)-(\d*)", request.headers.get("Range", "").strip())
    if wanted is None or wanted.groups() == ("", ""):
        response: HttpResponseBase = FileResponse(
            path.open("rb"),
            as_attachment=as_attachment,
            filename=filename,
            content_type="video/mp4",
        )
        response["Accept-Ranges"] = "bytes"
        return response
    first, last = wanted.groups()
    if first:
        start, end = int(first), min(int(last) if last else size - 1, size - 1)
    else:  # "bytes=-500": the last 500 bytes
        start, end = max(0, size - int(last)), size - 1
    if start > end or start >= size:
        response = HttpResponse(status=416)
        response["Content-Range"] = f"bytes */{size}"
        return response
    handle = path.open("rb")
    handle.seek(start)
    length = end - start + 1
    response = StreamingHttpResponse(_read(handle, length), status=206, content_type="video/mp4")
    response["Content-Range"] = f"bytes {start}-{end}/{size}"
    response["Content-Length"] = str(length)
    response["Accept-Ranges"] = "bytes"
    disposition = content_disposition_header(as_attachment, filename)
    if disposition:  # always, given a filename
        response["Content-Disposition"] = disposition
    return response


def _read(handle: BinaryIO, length: int) -> Iterator[bytes]:
    with handle:
        while length > 0:
            chunk = handle.read(min(RANGE_CHUNK, length))
            if not chunk:
                return
            length -= len(chunk)
            yield chunk
