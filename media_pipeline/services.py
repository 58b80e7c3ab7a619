"""The work of media_pipeline: store an upload, probe it, transcode each format and take its
poster frame, settle the video.

Plain functions with keyword-only arguments, callable from views, jobs, commands and tests.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.files.uploadedfile import UploadedFile
from django.db import transaction

from jobs import AlreadyFinished, JobCancelled, cancel
from jobs.models import Job
from web.uploads import upload_limit_message

from . import ffmpeg
from .exceptions import InvalidUpload, NotAVideo, UploadTooLarge
from .ladder import LADDER, frame_size
from .models import Rendition, RenditionFormat, RenditionStatus, Video, VideoStatus

if TYPE_CHECKING:
    # PlatformTask[P, R] is what @job returns: a job passed in is checked against its arguments.
    from jobs import JobHandle, PlatformTask

logger = logging.getLogger(__name__)

FORMAT_ORDER: list[str] = list(RenditionFormat.values)


def media_path(relative: str) -> Path:
    return Path(settings.MEDIA_ROOT) / relative


def formats_parse(values: Iterable[str] | None) -> list[str]:
    """The requested formats in ladder order, without repeats; "360p,720p" counts as two.

    None (the field left out) means every format.
    """
    if values is None:
        return list(FORMAT_ORDER)
    wanted = [
        part.strip().lower() for value in values for part in str(value).split(",") if part.strip()
    ]
    unknown = [value for value in wanted if value not in FORMAT_ORDER]
    if unknown:
        raise InvalidUpload(
            f"formats: unknown format {unknown[0]!r}; choose from {', '.join(FORMAT_ORDER)}",
            field="formats",
        )
    if not wanted:
        raise InvalidUpload(
            f"formats: choose at least one of {', '.join(FORMAT_ORDER)}", field="formats"
        )
    return [value for value in FORMAT_ORDER if value in wanted]


def display_name(name: str | None) -> str:
    """The client's file name reduced to something safe to show (never used as a path)."""
    base = PurePosixPath((name or "").replace("\\", "/")).name
    return "".join(ch for ch in base if ch.isprintable()).strip()[:255]


def video_create(
    *,
    owner: Any,
    upload: UploadedFile,
    formats: Iterable[str] | None,
    process_job: PlatformTask[[str], dict[str, Any]],
) -> tuple[Video, JobHandle]:
    """Store an upload under a generated name, record it and enqueue its `process_job`
    (media_pipeline.tasks.video_process_job).

    Raises InvalidUpload (a bad format, an empty file) or UploadTooLarge before anything is
    stored. The file is moved (or copied in chunks) from the upload's temporary file, never read
    into memory whole. The job is published once the transaction commits.
    """
    chosen = formats_parse(formats)
    limit = settings.BACKLOT_MAX_UPLOAD_BYTES
    if upload.size is None or upload.size > limit:
        raise UploadTooLarge(upload_limit_message(size=upload.size, limit=limit), field="file")
    if upload.size == 0:
        raise InvalidUpload("file: the file is empty", field="file")
    video = Video(owner=owner, original_name=display_name(upload.name), source_size=upload.size)
    folder = media_path(video.folder)
    try:
        video.source.save("original", upload, save=False)
        with transaction.atomic():
            video.save(force_insert=True)
            Rendition.objects.bulk_create(Rendition(video=video, format=f) for f in chosen)
            handle = process_job.using(owner=owner, idempotency_key=f"video:{video.id}").enqueue(
                str(video.id)
            )
            video.job_id = uuid.UUID(handle.id)
            video.save(update_fields=["job_id"])
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    logger.info(
        "Video %s stored (%s bytes, %s); job %s", video.id, upload.size, ",".join(chosen), handle.id
    )
    return video, handle


def video_probe(*, video_id: str) -> Video:
    """Read the source's duration and picture size with ffmpeg.

    A file ffmpeg cannot read as a video marks the video failed and raises NotAVideo (a
    Permanent error: the job is not retried). A video already transcoding or ready is left as it
    is (the job ran again after a redelivery).
    """
    video = Video.objects.get(pk=video_id)
    if video.status in (VideoStatus.TRANSCODING, VideoStatus.READY):
        return video
    video.mark_probing()
    try:
        found = ffmpeg.probe(Path(video.source.path))
    except NotAVideo as exc:
        video.mark_failed(error=str(exc))
        logger.info("Video %s is not a video: %s", video.id, exc)
        raise
    video.mark_probed(
        container=found.container, duration=found.duration, width=found.width, height=found.height
    )
    return video


def video_give_up(*, video_id: str, error: str) -> None:
    """The processing job gave up: a video it left waiting is marked failed with the error."""
    video = Video.objects.filter(pk=video_id).first()
    if video is not None:
        video.mark_failed(error=error)  # only from queued/probing: a started video stays


@dataclass(frozen=True)
class PlannedRendition:
    """One transcode to start: the rendition and the id its job will have."""

    rendition_id: int
    format: str
    job_id: str


def video_transcode_plan(*, video_id: str) -> list[PlannedRendition]:
    """Give each rendition its job id and mark the video transcoding; returns what to start.

    Empty when the transcodes were started before. The one exception: a crash between this
    commit and the jobs' enqueue leaves job ids with no jobs behind them, and a re-run of the
    processing job gets the same plan again.
    """
    with transaction.atomic():
        video = Video.objects.select_for_update().get(pk=video_id)
        renditions = list(video.renditions.select_for_update().order_by("pk"))
        if video.status == VideoStatus.TRANSCODING and all(r.job_id for r in renditions):
            if Job.objects.filter(id__in=[r.job_id for r in renditions]).exists():
                return []
            logger.warning("Video %s was marked transcoding but its jobs were never sent", video.id)
            return [PlannedRendition(r.pk, r.format, str(r.job_id)) for r in renditions]
        if video.status != VideoStatus.PROBING or not (video.width and video.height):
            return []
        planned = []
        for rendition in renditions:
            width, height = frame_size(video.width, video.height, LADDER[rendition.format].lines)
            if rendition.assign_job(job_id=uuid.uuid4(), width=width, height=height):
                planned.append(rendition)  # not one that is running or written already
        video.mark_transcoding()
    return [PlannedRendition(r.pk, r.format, str(r.job_id)) for r in planned]


class _RenditionProgress:
    """Passes each new percentage to the job and raises the rendition row's, throttled.

    ffmpeg reports twice a second (its -stats_period default), so the row takes at most one
    UPDATE per BACKLOT['PROGRESS_INTERVAL']; a skipped value is overtaken by the next report.
    """

    def __init__(self, rendition: Rendition, on_progress: Callable[[int], None] | None) -> None:
        self.rendition = rendition
        self.on_progress = on_progress
        self.interval = float(settings.BACKLOT["PROGRESS_INTERVAL"])
        self.last_write = 0.0

    def __call__(self, percent: int) -> None:
        now = time.monotonic()
        if now - self.last_write >= self.interval:
            self.last_write = now
            self.rendition.report_progress(percent)
        if self.on_progress is not None:
            self.on_progress(percent)


def rendition_transcode(
    *, rendition_id: int, on_progress: Callable[[int], None] | None = None
) -> Rendition:
    """Transcode one format of a video; progress 0-99 goes to `on_progress` and the row.

    ffmpeg writes a temporary name in the video's folder; only a complete, probed file is
    renamed into place and recorded, so a killed worker leaves no half-written file recorded
    as done. Already written (a redelivery): returns at once. A failure records ffmpeg's
    message on the rendition and re-raises for the job's retry policy to decide.
    """
    rendition = Rendition.objects.select_related("video").get(pk=rendition_id)
    video = rendition.video
    if rendition.status == RenditionStatus.READY and media_path(rendition.path).is_file():
        return rendition
    if rendition.status == RenditionStatus.CANCELLED:
        return rendition  # cancelled while its message was on its way: never transcoded
    rung = LADDER[rendition.format]
    folder = media_path(video.folder) / "renditions"
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"{rendition.format}.mp4"
    for stale in folder.glob(f".{rendition.format}.*.part"):  # left by a killed attempt
        stale.unlink(missing_ok=True)
    partial = folder / f".{rendition.format}.{uuid.uuid4().hex}.part"
    rendition.mark_running()
    try:
        source = Path(video.source.path)
        source_probe = ffmpeg.probe(source)
        size = frame_size(source_probe.width, source_probe.height, rung.lines)
        ffmpeg.transcode(
            source=source,
            target=partial,
            size=size,
            rung=rung,
            source_probe=source_probe,
            on_progress=_RenditionProgress(rendition, on_progress),
        )
        written = ffmpeg.probe(partial)
        _fsync(partial)
        os.replace(partial, final)
        _fsync(folder)
    except JobCancelled:
        raise  # ffmpeg is stopped and the partial file removed; the job's hook marks it
    except Exception as exc:
        rendition.mark_attempt_failed(error=str(exc) or type(exc).__name__)
        raise
    finally:
        partial.unlink(missing_ok=True)
    rendition.mark_ready(
        path=f"{video.folder}/renditions/{final.name}",
        size_bytes=final.stat().st_size,
        width=written.width,
        height=written.height,
        duration=written.duration,
    )
    logger.info("Video %s: %s written (%s bytes)", video.id, rendition.format, rendition.size_bytes)
    return rendition


# The poster is the frame a quarter into the rendition (past a fade-in or a title card), at
# most POSTER_LATEST seconds in: ffmpeg seeks to a keyframe before it and decodes from there.
POSTER_AT = 0.25
POSTER_LATEST = 10.0


def poster_time(duration: float | None) -> float:
    """Seconds into a rendition of `duration` seconds its poster frame is taken at."""
    return min(POSTER_LATEST, POSTER_AT * duration) if duration and duration > 0 else 0.0


def rendition_poster(*, rendition_id: int) -> Rendition:
    """Take a written rendition's poster frame: a JPEG next to it, recorded on the row.

    Read from the rendition's own file, so it has the rendition's picture size. Written to a
    temporary name (removed by a cancel's hook, like a transcode's) and renamed into place; a
    rendition not ready (cancelled while its transcode ran) is left without one, and one that
    has its poster already returns at once. A failure is re-raised for the job's retry policy:
    the transcode before it is a finished step and does not run again.
    """
    rendition = Rendition.objects.select_related("video").get(pk=rendition_id)
    if rendition.status != RenditionStatus.READY or not rendition.path:
        return rendition
    if rendition.poster_path and media_path(rendition.poster_path).is_file():
        return rendition
    written = media_path(rendition.path)
    folder = written.parent
    final = folder / f"{rendition.format}.jpg"
    for stale in folder.glob(f".{rendition.format}.*.part"):  # left by a killed attempt
        stale.unlink(missing_ok=True)
    partial = folder / f".{rendition.format}.{uuid.uuid4().hex}.part"
    try:
        ffmpeg.poster(source=written, target=partial, at=poster_time(rendition.duration))
        os.replace(partial, final)
    finally:
        partial.unlink(missing_ok=True)
    rendition.record_poster(path=f"{rendition.video.folder}/renditions/{final.name}")
    logger.info("Video %s: %s poster taken", rendition.video_id, rendition.format)
    return rendition


def _fsync(path: Path) -> None:
    """Flush a file (or a folder's entries) to disk, so a rename survives a power cut."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def video_finish(*, video_id: str) -> Video:
    """Settle a video from its renditions: ready when all are, failed naming each failed format.

    The transcode chord calls this when every format has finished, whether they all succeeded
    or not; it is safe to call at any time and again (a replayed format that now succeeds turns
    a failed video ready). While a format still runs, the video is left as it is.
    """
    with transaction.atomic():
        video = Video.objects.select_for_update().get(pk=video_id)
        renditions = list(video.renditions.order_by("pk"))
        if not renditions or video.status == VideoStatus.READY:
            return video
        if all(r.status == RenditionStatus.READY for r in renditions):
            video.mark_ready()
            logger.info("Video %s ready", video.id)
        elif all(r.is_finished for r in renditions):
            failed = [r for r in renditions if r.status == RenditionStatus.FAILED]
            error = "\n".join(f"{r.format} failed: {r.error}" for r in failed)
            if not failed:
                video.mark_cancelled()  # the rest written, a cancelled format never will be
            elif video.mark_transcode_failed(error=error):
                logger.info("Video %s failed: %s", video.id, ", ".join(r.format for r in failed))
    return video


def video_settle_gave_up(*, video_id: str, error: str) -> None:
    """The settling job (video_finish as the renditions' batch callback) gave up: a video it
    left transcoding is failed with the error (a settled one stays as it is)."""
    video = Video.objects.filter(pk=video_id).first()
    if video is not None and video.mark_transcode_failed(error=error):
        logger.info("Video %s failed: its settling job gave up", video.id)


def rendition_give_up(*, rendition_id: int, error: str) -> Video:
    """A transcode job gave up: its rendition is failed (even if the job was killed before it
    could say so) and the video is settled if nothing else still runs."""
    rendition = Rendition.objects.get(pk=rendition_id)
    rendition.mark_failed(error=error)  # a written one stays ready
    return video_finish(video_id=str(rendition.video_id))


# --- cancel ----------------------------------------------------------------------------


def video_cancel(*, video: Video, by: Any = None) -> list[str]:
    """Cancel a video's processing: its processing job with the jobs it fanned out, or, once
    that job has finished, the job of every format still waiting or running.

    Returns the ids of the jobs cancelled or asked to stop (empty: everything had finished
    already, and the video is left as it is). The video and those renditions read cancelled at
    once; the jobs' on_cancelled hooks (rendition_cancelled, video_cancelled) say so again
    when a run has stopped, and remove a partial file.
    """
    if video.status == VideoStatus.CANCELLED:
        # cancelled once already: the stops that cancel asked for are under way, and asking
        # a running job again would stop nothing more
        return []
    renditions = [r for r in video.renditions.all() if r.job_id and not r.is_finished]
    stopped: list[str] = []
    for job_id in [video.job_id, *(r.job_id for r in renditions)]:
        if job_id is None or str(job_id) in stopped:
            continue  # a format's job already cancelled with the processing job
        try:
            outcome = cancel(job_id, by=by)
        except (AlreadyFinished, Job.DoesNotExist):
            continue
        stopped += [*outcome.cancelled, *outcome.requested]
    if not stopped:
        return []
    video.mark_cancelled()
    for rendition in renditions:
        if str(rendition.job_id) in stopped:
            rendition.mark_cancelled()
    logger.info("Video %s cancelled (%s jobs)", video.id, len(stopped))
    return stopped


def video_cancelled(*, video_id: str) -> None:
    """The processing job (or the settling job) was cancelled: the video and every format not
    written yet are cancelled."""
    video = Video.objects.filter(pk=video_id).first()
    if video is None:
        return
    for rendition in video.renditions.all():
        rendition.mark_cancelled()
    video.mark_cancelled()


def rendition_cancelled(*, rendition_id: int) -> None:
    """A format's transcode job was cancelled (waiting, or its run stopped): the rendition is
    cancelled, a partial file its ffmpeg left is removed, and the video is cancelled too (it
    can no longer become ready)."""
    rendition = Rendition.objects.select_related("video").filter(pk=rendition_id).first()
    if rendition is None:
        return
    folder = media_path(rendition.video.folder) / "renditions"
    for partial in folder.glob(f".{rendition.format}.*.part"):
        partial.unlink(missing_ok=True)
    rendition.mark_cancelled()
    rendition.video.mark_cancelled()
