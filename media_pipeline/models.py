"""Uploaded videos and the renditions transcoded from them."""

from __future__ import annotations

import uuid
from collections.abc import Collection

from django.conf import settings
from django.core.validators import MaxValueValidator
from django.db import models
from django.db.models import Q
from django.utils import timezone

from jobs import OwnedQuerySet


class VideoStatus(models.TextChoices):
    """Where a video is in its life.

    queued -> probing -> transcoding -> ready, or failed: from queued/probing (not a video, or
    the processing job gave up) or from transcoding (a format failed). A failed video whose
    failed format is replayed successfully becomes ready. Any time before it settles it can
    be cancelled (its jobs are cancelled; a format written before stays ready).
    """

    QUEUED = "queued", "Queued"  # stored; the probe job has not started
    PROBING = "probing", "Probing"  # ffmpeg reads the source's streams and duration
    TRANSCODING = "transcoding", "Transcoding"  # one job per format runs (a chord)
    READY = "ready", "Ready"  # every rendition is written
    FAILED = "failed", "Failed"  # not a video, or a format failed; `error` says which
    CANCELLED = "cancelled", "Cancelled"  # someone cancelled it; nothing more is transcoded


FINISHED_VIDEO_STATES = (VideoStatus.READY, VideoStatus.FAILED, VideoStatus.CANCELLED)


class RenditionFormat(models.TextChoices):
    """The formats a video can be transcoded to (see media_pipeline.ladder)."""

    P360 = "360p", "360p"  # 640x360 for a 16:9 source
    P720 = "720p", "720p"  # 1280x720
    P1080 = "1080p", "1080p"  # 1920x1080


class RenditionStatus(models.TextChoices):
    """Where one format's transcode is: queued -> running -> ready, or back to queued after a
    failed attempt, or failed once its job gave up (a replay runs it again); queued/running ->
    cancelled when its job is cancelled (ffmpeg is stopped, the partial file removed)."""

    QUEUED = "queued", "Queued"  # waiting for the probe, a worker, or its next attempt
    RUNNING = "running", "Running"  # ffmpeg is writing it (under a temporary name)
    READY = "ready", "Ready"  # written, renamed into place, probed
    FAILED = "failed", "Failed"  # its job gave up; `error` has ffmpeg's message
    CANCELLED = "cancelled", "Cancelled"  # its job was cancelled; never written, not run again


FINISHED_RENDITION_STATES = (
    RenditionStatus.READY,
    RenditionStatus.FAILED,
    RenditionStatus.CANCELLED,
)


def video_source_path(video: Video, filename: str) -> str:
    """Where an upload is stored: a generated name; the client's file name is never a path."""
    return f"videos/{video.id}/source/original"


class VideoQuerySet(OwnedQuerySet["Video"]):
    """Videos: visible_to(user) and owned_by(user) from jobs.OwnedQuerySet."""


def _move(row: models.Model, sources: Collection[str], **changes: object) -> bool:
    """Apply `changes` to `row` if its status is still one of `sources`; True if it moved.

    One guarded UPDATE, so a late or duplicate job cannot move a row backwards; the instance
    follows only when the database did.
    """
    moved = type(row)._default_manager.filter(pk=row.pk, status__in=sources).update(**changes)
    if moved:
        for name, value in changes.items():
            setattr(row, name, value)
    return bool(moved)


class Video(models.Model):
    """An uploaded source video; its renditions are the formats transcoded from it."""

    id = models.UUIDField(
        "video id",
        primary_key=True,
        default=uuid.uuid4,
        editable=False,
        help_text="Public id; also names the video's folder under MEDIA_ROOT/videos/.",
    )
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        related_name="videos",
        verbose_name="owner",
        help_text="User who uploaded it; only they and staff may see it.",
    )
    original_name = models.CharField(
        "original name",
        max_length=255,
        blank=True,
        default="",
        help_text="File name the client sent, for display only; never used as a path.",
    )
    source = models.FileField(
        "source file",
        upload_to=video_source_path,
        max_length=255,
        help_text="The upload as received, under a generated name.",
    )
    source_size = models.PositiveBigIntegerField(
        "source size (bytes)", default=0, help_text="Size of the uploaded file."
    )
    status = models.CharField(
        "status",
        max_length=16,
        choices=VideoStatus.choices,
        default=VideoStatus.QUEUED,
        help_text="Where the video is in its life.",
    )
    container = models.CharField(
        "container",
        max_length=100,
        blank=True,
        default="",
        help_text="Format ffmpeg read the source as (e.g. mov,mp4,m4a,3gp,3g2,mj2).",
    )
    duration = models.FloatField(
        "duration (s)", null=True, blank=True, help_text="Length of the source, probed by ffmpeg."
    )
    width = models.PositiveIntegerField(
        "width", null=True, blank=True, help_text="Source picture width in pixels, as displayed."
    )
    height = models.PositiveIntegerField(
        "height", null=True, blank=True, help_text="Source picture height in pixels, as displayed."
    )
    error = models.TextField(
        "error",
        blank=True,
        default="",
        help_text="Why it failed: ffmpeg's message, and which format when a transcode failed.",
    )
    job_id = models.UUIDField(
        "job id",
        null=True,
        blank=True,
        help_text="The job that probes it and starts the transcodes.",
    )
    created_at = models.DateTimeField(
        "uploaded", default=timezone.now, help_text="Upload accepted."
    )
    probed_at = models.DateTimeField(
        "probed", null=True, blank=True, help_text="ffmpeg read the source's streams."
    )
    finished_at = models.DateTimeField(
        "finished", null=True, blank=True, help_text="Became ready or failed."
    )

    objects = VideoQuerySet.as_manager()

    class Meta:
        verbose_name = "video"
        verbose_name_plural = "videos"
        ordering = ("-created_at",)
        indexes = [
            models.Index(fields=["owner", "created_at"], name="video_owner_idx"),
            models.Index(fields=["status", "created_at"], name="video_status_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.original_name or self.id} ({self.status})"

    @property
    def folder(self) -> str:
        """The video's folder, relative to MEDIA_ROOT."""
        return f"videos/{self.id}"

    @property
    def resolution(self) -> str:
        return f"{self.width}x{self.height}" if self.width and self.height else ""

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_VIDEO_STATES

    # --- state changes (each a guarded UPDATE "from X to Y"; True if the video moved) ------
    def mark_probing(self) -> bool:
        """queued/probing/failed -> probing: the processing job starts (again, after a retry or
        a replay)."""
        return _move(
            self,
            [VideoStatus.QUEUED, VideoStatus.PROBING, VideoStatus.FAILED],
            status=VideoStatus.PROBING,
            error="",
            finished_at=None,
        )

    def mark_probed(self, *, container: str, duration: float, width: int, height: int) -> bool:
        """probing: ffmpeg read the source's streams and duration."""
        return _move(
            self,
            [VideoStatus.PROBING],
            container=container[:100],
            duration=duration,
            width=width,
            height=height,
            probed_at=timezone.now(),
        )

    def mark_transcoding(self) -> bool:
        """probing -> transcoding: the job of each format is planned."""
        return _move(self, [VideoStatus.PROBING], status=VideoStatus.TRANSCODING)

    def mark_ready(self) -> bool:
        """transcoding/failed -> ready: every format is written (failed: a replayed format that
        failed before now succeeded)."""
        return _move(
            self,
            [VideoStatus.TRANSCODING, VideoStatus.FAILED],
            status=VideoStatus.READY,
            error="",
            finished_at=timezone.now(),
        )

    def mark_failed(self, *, error: str) -> bool:
        """queued/probing -> failed: not a video, or the processing job gave up."""
        return _move(
            self,
            [VideoStatus.QUEUED, VideoStatus.PROBING],
            status=VideoStatus.FAILED,
            error=error,
            finished_at=timezone.now(),
        )

    def mark_transcode_failed(self, *, error: str) -> bool:
        """transcoding -> failed: every format finished and at least one failed (`error` names
        each)."""
        return _move(
            self,
            [VideoStatus.TRANSCODING],
            status=VideoStatus.FAILED,
            error=error,
            finished_at=timezone.now(),
        )

    def mark_cancelled(self) -> bool:
        """queued/probing/transcoding -> cancelled: its jobs were cancelled (a ready or failed
        video has settled and stays)."""
        return _move(
            self,
            [VideoStatus.QUEUED, VideoStatus.PROBING, VideoStatus.TRANSCODING],
            status=VideoStatus.CANCELLED,
            finished_at=timezone.now(),
        )

    def progress_percent(self, renditions: list[Rendition] | None = None) -> float:
        """Overall progress: the mean of the renditions' (100 once ready)."""
        if self.status == VideoStatus.READY:
            return 100.0
        renditions = list(self.renditions.all()) if renditions is None else renditions
        if not renditions:
            return 0.0
        return round(sum(r.progress for r in renditions) / len(renditions), 1)


class Rendition(models.Model):
    """One format of a video, written by one transcode job."""

    video = models.ForeignKey(
        Video,
        on_delete=models.CASCADE,
        related_name="renditions",
        verbose_name="video",
        help_text="The source it is transcoded from.",
    )
    format = models.CharField(
        "format",
        max_length=8,
        choices=RenditionFormat.choices,
        help_text="Target format: the short side of the picture in pixels.",
    )
    width = models.PositiveIntegerField(
        "width", null=True, blank=True, help_text="Picture width in pixels (planned, then probed)."
    )
    height = models.PositiveIntegerField(
        "height",
        null=True,
        blank=True,
        help_text="Picture height in pixels (planned, then probed).",
    )
    duration = models.FloatField(
        "duration (s)",
        null=True,
        blank=True,
        help_text="Length of the written file, probed by ffmpeg.",
    )
    size_bytes = models.PositiveBigIntegerField(
        "size (bytes)", null=True, blank=True, help_text="Size of the written file."
    )
    path = models.CharField(
        "path",
        max_length=255,
        blank=True,
        default="",
        help_text="File relative to MEDIA_ROOT; set only once the file is complete.",
    )
    poster_path = models.CharField(
        "poster path",
        max_length=255,
        blank=True,
        default="",
        help_text="JPEG of one frame of the written file, relative to MEDIA_ROOT; set once the "
        "poster is complete (the job's second step, after the transcode).",
    )
    status = models.CharField(
        "status",
        max_length=16,
        choices=RenditionStatus.choices,
        default=RenditionStatus.QUEUED,
        help_text="Where this format's transcode is.",
    )
    progress = models.PositiveSmallIntegerField(
        "progress (%)",
        default=0,
        validators=[MaxValueValidator(100)],
        help_text="0-100; only ever rises, across retries too.",
    )
    job_id = models.UUIDField(
        "job id", null=True, blank=True, help_text="The transcode job (also its Celery task id)."
    )
    error = models.TextField(
        "error", blank=True, default="", help_text="Why the last attempt failed (ffmpeg's message)."
    )
    started_at = models.DateTimeField(
        "started", null=True, blank=True, help_text="Latest attempt started."
    )
    finished_at = models.DateTimeField(
        "finished", null=True, blank=True, help_text="Written, or the last attempt failed."
    )

    class Meta:
        verbose_name = "rendition"
        verbose_name_plural = "renditions"
        ordering = ("video", "format")
        constraints = [
            models.UniqueConstraint(fields=["video", "format"], name="rendition_video_format_uniq"),
            models.CheckConstraint(
                condition=Q(progress__lte=100), name="rendition_progress_lte_100"
            ),
        ]
        indexes = [models.Index(fields=["job_id"], name="rendition_job_idx")]

    def __str__(self) -> str:
        return f"{self.video_id} {self.format} ({self.status})"

    @property
    def resolution(self) -> str:
        return f"{self.width}x{self.height}" if self.width and self.height else ""

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_RENDITION_STATES

    # --- state changes (each a guarded UPDATE "from X to Y"; True if the rendition moved) --
    def assign_job(self, *, job_id: uuid.UUID, width: int, height: int) -> bool:
        """queued/failed -> queued: its transcode job `job_id` is planned, at this frame size."""
        return _move(
            self,
            [RenditionStatus.QUEUED, RenditionStatus.FAILED],
            job_id=job_id,
            width=width,
            height=height,
            status=RenditionStatus.QUEUED,
        )

    def mark_running(self) -> bool:
        """queued/running/failed/ready -> running: an attempt starts (running: after a killed
        worker; failed: a replay; ready: the written file is gone)."""
        return _move(
            self,
            [
                RenditionStatus.QUEUED,
                RenditionStatus.RUNNING,
                RenditionStatus.FAILED,
                RenditionStatus.READY,
            ],
            status=RenditionStatus.RUNNING,
            error="",
            started_at=timezone.now(),
            finished_at=None,
        )

    def report_progress(self, percent: int) -> bool:
        """Raise the stored progress to `percent`; a lower value (a retry) changes nothing."""
        percent = max(0, min(100, int(percent)))
        updated = Rendition.objects.filter(pk=self.pk, progress__lt=percent).update(
            progress=percent
        )
        if updated:
            self.progress = percent
        return bool(updated)

    def mark_ready(
        self, *, path: str, size_bytes: int, width: int, height: int, duration: float
    ) -> bool:
        """running -> ready: the file is complete, renamed into place and probed."""
        return _move(
            self,
            [RenditionStatus.RUNNING],
            status=RenditionStatus.READY,
            path=path,
            size_bytes=size_bytes,
            width=width,
            height=height,
            duration=duration,
            progress=100,
            error="",
            finished_at=timezone.now(),
        )

    def record_poster(self, *, path: str) -> bool:
        """ready: its poster frame is written and renamed into place (a rendition that is no
        longer ready keeps no poster)."""
        return _move(self, [RenditionStatus.READY], poster_path=path)

    def mark_attempt_failed(self, *, error: str) -> bool:
        """running -> queued: an attempt failed; queued for the next one, unless the job gives
        up (mark_failed)."""
        return _move(self, [RenditionStatus.RUNNING], status=RenditionStatus.QUEUED, error=error)

    def mark_failed(self, *, error: str) -> bool:
        """queued/running/failed -> failed: its job gave up (a ready rendition stays)."""
        return _move(
            self,
            [RenditionStatus.QUEUED, RenditionStatus.RUNNING, RenditionStatus.FAILED],
            status=RenditionStatus.FAILED,
            error=error,
            finished_at=timezone.now(),
        )

    def mark_cancelled(self) -> bool:
        """queued/running -> cancelled: its job was cancelled before the file was complete (a
        ready rendition stays ready, a failed one failed)."""
        return _move(
            self,
            [RenditionStatus.QUEUED, RenditionStatus.RUNNING],
            status=RenditionStatus.CANCELLED,
            finished_at=timezone.now(),
        )
