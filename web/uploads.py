"""Upload limits enforced while the request body is read, not after it has been stored.

Call `limit_upload` before anything reads request.POST or request.FILES: a body whose declared
length is already over the limit is refused unread, and a file that grows past it stops the
parse there (the part read so far is in a temporary file that Django deletes). Files always
stream to a temporary file on disk, however small.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.conf import settings
from django.core.files.uploadhandler import (
    FileUploadHandler,
    StopUpload,
    TemporaryFileUploadHandler,
)
from django.http import HttpRequest, HttpResponse, JsonResponse

# Multipart framing and the small form fields ride along with the file: boundaries, part
# headers, a CSRF token and a few format names come to well under 4 KiB; this allows for more.
MULTIPART_OVERHEAD = 64 * 1024


class SizeLimitHandler(FileUploadHandler):
    """Stops the upload as soon as one file passes `limit` bytes."""

    def __init__(self, request: HttpRequest, limit: int) -> None:
        super().__init__(request)
        self.limit = limit
        self.exceeded = False

    def receive_data_chunk(self, raw_data: bytes, start: int) -> bytes:
        if start + len(raw_data) > self.limit:
            self.exceeded = True
            # connection_reset: the rest of the body is not read (and not written anywhere)
            raise StopUpload(connection_reset=True)
        return raw_data

    def file_complete(self, file_size: int) -> None:
        return None  # the next handler (the temporary file) makes the file


class UploadCheck:
    """The outcome of `limit_upload` for one request."""

    def __init__(self, request: HttpRequest, limit: int) -> None:
        self.limit = limit
        self.declared = _declared_length(request)
        self.handler: SizeLimitHandler | None = None
        if not self.refused_unread:
            self.handler = SizeLimitHandler(request, limit)
            request.upload_handlers = [self.handler, TemporaryFileUploadHandler(request)]

    @property
    def refused_unread(self) -> bool:
        """The declared body length alone is over the limit: do not read it."""
        return self.declared is not None and self.declared > self.limit + MULTIPART_OVERHEAD

    @property
    def too_large(self) -> bool:
        return self.refused_unread or bool(self.handler and self.handler.exceeded)


def limit_upload(request: HttpRequest, limit: int | None = None) -> UploadCheck:
    return UploadCheck(request, settings.BACKLOT_MAX_UPLOAD_BYTES if limit is None else limit)


def _declared_length(request: HttpRequest) -> int | None:
    value: Any = request.META.get("CONTENT_LENGTH")
    try:
        return int(value) if value else None
    except (TypeError, ValueError):
        return None


def upload_limit_message(*, size: int | None, limit: int) -> str:
    said = f"The file is {_megabytes(size)}; " if size else "The upload is too large; "
    return f"{said}uploads are limited to {_megabytes(limit)} ({limit} bytes)."


def _megabytes(size: int) -> str:
    return f"{size / 1_000_000:.1f} MB" if size >= 100_000 else f"{size} bytes"


def too_large_response(check: UploadCheck) -> JsonResponse:
    size = check.declared if check.refused_unread else None
    return JsonResponse({"detail": upload_limit_message(size=size, limit=check.limit)}, status=413)


def upload_limited(run: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """For API views (ninja's decorate_view): apply the upload limit before anything reads the
    multipart body; an upload over BACKLOT_MAX_UPLOAD_BYTES gets 413 and nothing is stored."""

    @wraps(run)
    def limited(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        check = limit_upload(request)
        if check.refused_unread:
            return too_large_response(check)
        response = run(request, *args, **kwargs)
        return too_large_response(check) if check.too_large else response

    return limited
