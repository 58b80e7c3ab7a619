"""Jobs of media_pipeline: probe an upload, transcode its formats in parallel, settle the video.

video_process_job ──> batch( rendition_transcode_job x formats ) ──> video_finish_job
                            on_complete (ready, or failed naming the failed formats, or cancelled)
                            and on_success (a replayed format that now succeeds: ready)

Each transcode job is two durable steps (jobs.worker.steps): "transcode" runs ffmpeg to write
the format, "poster" takes a JPEG frame from the written file. A retry after the poster
failed, or a dead letter's replay, does not run the transcode's ffmpeg again; a poster that
gives up leaves its format ready without one (the dead letter says why; its replay takes only
the poster).

Thin: each unpacks ids and calls media_pipeline.services (which never import this); each
keeps the Celery name it was registered under. Cancelling the processing job cancels the
transcodes it started and their settling job (jobs.cancel follows Job.parent); each job's
on_cancelled hook marks its rows cancelled, each on_dead hook marks them failed with the reason
(the settling job's hooks read the video id after the batch id).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import transaction

import jobs
from jobs import RetryPolicy, job

from . import services
from .exceptions import MediaPipelineError
from .models import Rendition

# Reading a header is instant; a file without a duration in its header is measured by a copy
# pass (services.ffmpeg.MEASURE_TIMEOUT, 600 s).
PROCESS_TIME_LIMIT = 900
# A transcode of a long 1080p source: one hour per attempt (the soft limit, at 90%, stops
# ffmpeg and counts as a failed attempt; the second attempt starts from scratch).
TRANSCODE_TIME_LIMIT = 3600


def _reason(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, MediaPipelineError) else f"{type(exc).__name__}: {exc}"


def _process_gave_up(exc: BaseException, args: tuple, kwargs: dict) -> None:
    services.video_give_up(video_id=str(kwargs.get("video_id") or args[0]), error=_reason(exc))


def _transcode_gave_up(exc: BaseException, args: tuple, kwargs: dict) -> None:
    # Also settles the video: a job killed for good (its worker died too often) never reports
    # to its chord, which would otherwise leave the video transcoding.
    rendition_id = int(kwargs.get("rendition_id") or args[0])
    services.rendition_give_up(rendition_id=rendition_id, error=_reason(exc))


def _video_cancelled(args: tuple, kwargs: dict) -> None:
    services.video_cancelled(video_id=str(kwargs.get("video_id") or args[0]))


def _settled_video(args: tuple, kwargs: dict) -> str:
    """The video of a settling job: (batch id, video id) as a batch callback, (video id) as a
    chord's callback sent before the renditions moved onto batches."""
    return str(kwargs.get("video_id") or (args[1] if len(args) > 1 else args[0]))


def _settling_gave_up(exc: BaseException, args: tuple, kwargs: dict) -> None:
    services.video_settle_gave_up(
        video_id=_settled_video(args, kwargs), error=f"the settling job gave up: {_reason(exc)}"
    )


def _settling_cancelled(args: tuple, kwargs: dict) -> None:
    services.video_cancelled(video_id=_settled_video(args, kwargs))


def _uploader(args: tuple, kwargs: dict) -> Any:
    """Concurrency key of a transcode: the user whose video it is (TRANSCODES_PER_USER)."""
    rendition_id = int(kwargs.get("rendition_id") or args[0])
    return (
        Rendition.objects.filter(pk=rendition_id).values_list("video__owner_id", flat=True).first()
    )


def _rendition_cancelled(args: tuple, kwargs: dict) -> None:
    services.rendition_cancelled(rendition_id=int(kwargs.get("rendition_id") or args[0]))


@job(
    name="media_pipeline.video_process",
    queue="media",
    bind=True,
    time_limit=PROCESS_TIME_LIMIT,
    retry=RetryPolicy(max_attempts=2, base_delay=10, max_delay=60),
    on_dead=_process_gave_up,
    on_cancelled=_video_cancelled,
)
def video_process_job(self: Any, video_id: str) -> dict[str, Any]:
    """Probe the upload (not a video: dead letter at once), then start one job per format."""
    self.progress(0, 2, "reading the source")
    video = services.video_probe(video_id=video_id)
    self.progress(1, 2, "starting the transcodes")
    with transaction.atomic():  # the plan and its batch of transcodes commit together
        plan = services.video_transcode_plan(video_id=video_id)
        if plan:
            transcode_batch(video_id, plan)
    self.progress(2, 2, f"transcoding {len(plan)} format(s)" if plan else "already started")
    return {"video_id": video_id, "duration": video.duration, "started": [p.format for p in plan]}


def transcode_batch(video_id: str, plan: list[services.PlannedRendition]) -> jobs.Batch:
    """One transcode per format in parallel, as a batch (jobs.flow.batches): video_finish_job
    settles the video once every format has ended (on_complete: ready, or failed naming the
    failed formats), and again if a failed format's replay later makes every one succeed
    (on_success). Sent inside the plan's transaction: all of it commits, or none."""
    settle = video_finish_job.s(video_id)
    with jobs.batch(
        description=f"renditions of video {video_id}", on_complete=settle, on_success=settle
    ) as batch:
        for p in plan:
            rendition_transcode_job.apply_async((p.rendition_id,), task_id=p.job_id)
    return batch


# cancel="terminate": a cancel kills the pool process and, with it, ffmpeg (the worker kills the
# process's children first, and ffmpeg runs with PR_SET_PDEATHSIG, media_pipeline.ffmpeg). A
# cooperative stop at the next progress line would wait on ffmpeg, which writes none while
# +faststart rewrites a long file to move its index to the front, nor while its input stalls;
# the job would sit blocked on the pipe. The hook removes the partial file ffmpeg left.
@job(
    name="media_pipeline.rendition_transcode",
    queue="media",
    bind=True,
    time_limit=TRANSCODE_TIME_LIMIT,
    retry=RetryPolicy(max_attempts=2, base_delay=30, max_delay=300),
    on_dead=_transcode_gave_up,
    concurrency=settings.TRANSCODES_PER_USER,
    concurrency_key=_uploader,
    cancel="terminate",
    on_cancelled=_rendition_cancelled,
)
def rendition_transcode_job(self: Any, rendition_id: int) -> dict[str, Any]:
    """Transcode one format with ffmpeg, reporting its progress, then take its poster frame;
    each a step, so a retry of the poster does not transcode again."""

    @self.step("transcode")
    def transcode() -> dict[str, Any]:
        rendition = services.rendition_transcode(
            rendition_id=rendition_id,
            on_progress=lambda percent: self.progress(percent, 100, "encoding"),
        )
        return {
            "format": rendition.format,
            "video_id": str(rendition.video_id),
            "size_bytes": rendition.size_bytes,
        }

    @self.step("poster")
    def poster() -> str:
        return services.rendition_poster(rendition_id=rendition_id).poster_path

    written = transcode()
    self.progress(99, 100, f"{written['format']} written, taking its poster frame")
    poster()
    self.progress(100, 100, f"{written['format']} written")
    if not self.request.chord and jobs.current_batch() is None:
        # Run on its own (not one of a video's batch, nor of a chord sent before batches): no
        # callback will settle the video.
        services.video_finish(video_id=written["video_id"])
    return {"format": written["format"], "size_bytes": written["size_bytes"]}


@job(
    name="media_pipeline.video_finish",
    queue="media",
    time_limit=120,
    on_dead=_settling_gave_up,
    on_cancelled=_settling_cancelled,
)
def video_finish_job(first: str, video_id: str | None = None) -> str:
    """Mark the video ready, or failed naming the failed formats; returns its status. Called
    as a batch callback (batch id, video id), or with the video id alone (a chord's callback
    sent before the renditions moved onto batches)."""
    return services.video_finish(video_id=video_id or first).status
