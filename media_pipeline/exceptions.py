"""The errors media_pipeline raises; all derive from MediaPipelineError.

The job platform reads the second base class: a Permanent error goes to the dead letters at
once, a Retryable one is tried again per the job's retry policy.
"""

from __future__ import annotations

from jobs import Permanent, Retryable


class MediaPipelineError(Exception):
    """Base class of every error media_pipeline raises on purpose."""


class InvalidUpload(MediaPipelineError, ValueError):
    """An upload the API refuses (400); `field` names the form field at fault."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


class UploadTooLarge(InvalidUpload):
    """A file over settings.BACKLOT_MAX_UPLOAD_BYTES (413)."""


class NotAVideo(MediaPipelineError, Permanent):
    """ffmpeg cannot read a video stream from the file; carries ffmpeg's own message."""


class TranscodeFailed(MediaPipelineError, Permanent):
    """ffmpeg exited with an error while writing a rendition; carries ffmpeg's message."""


class TranscodeInterrupted(MediaPipelineError, Retryable):
    """ffmpeg was killed by a signal (an OOM kill, an operator): worth another attempt."""
