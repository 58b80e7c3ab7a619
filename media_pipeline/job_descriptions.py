"""How "My jobs" names the jobs of media_pipeline (jobs.describe_jobs): a video's processing
and settling jobs by the uploaded file's name, a transcode by its format and that name; each
links the video's page. One query per task per page. Registered by MediaPipelineConfig.ready()."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from django.urls import reverse

from jobs import JobDescription, describe_jobs

from .models import Rendition, Video


def _arg(job: Any, name: str, index: int) -> Any:
    if name in job.kwargs:
        return job.kwargs[name]
    return job.args[index] if len(job.args) > index else None


def _video_id(value: Any) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(value))
    except ValueError:
        return None


def _video_url(video_id: uuid.UUID) -> str:
    return reverse("media_pipeline:video_detail", kwargs={"video_id": video_id})


def _by_video(wanted: dict[Any, uuid.UUID | None], suffix: str = "") -> dict[Any, JobDescription]:
    names = dict(
        Video.objects.filter(pk__in=[v for v in wanted.values() if v]).values_list(
            "pk", "original_name"
        )
    )
    return {
        key: JobDescription((names[video_id] or f"video {video_id}") + suffix, _video_url(video_id))
        for key, video_id in wanted.items()
        if video_id in names
    }


def describe_processing(jobs: Sequence[Any]) -> dict[Any, JobDescription]:
    return _by_video({job.id: _video_id(_arg(job, "video_id", 0)) for job in jobs})


def describe_finishes(jobs: Sequence[Any]) -> dict[Any, JobDescription]:
    # a batch callback (batch id, video id), or the video id alone (before batches): it
    # settles the video (ready, or failed naming the failed formats)
    return _by_video(
        {job.id: _video_id(_arg(job, "video_id", 1) or _arg(job, "first", 0)) for job in jobs},
        suffix=": finish",
    )


def describe_transcodes(jobs: Sequence[Any]) -> dict[Any, JobDescription]:
    wanted = {job.id: _arg(job, "rendition_id", 0) for job in jobs}
    rows = {
        pk: (fmt, video_id, name)
        for pk, fmt, video_id, name in Rendition.objects.filter(
            pk__in=[r for r in wanted.values() if r is not None]
        ).values_list("pk", "format", "video_id", "video__original_name")
    }
    found = {}
    for key, rendition_id in wanted.items():
        if rendition_id in rows:
            fmt, video_id, name = rows[rendition_id]
            found[key] = JobDescription(f"{fmt} of {name or video_id}", _video_url(video_id))
    return found


def register() -> None:
    describe_jobs("media_pipeline.video_process", kind="Video", describe=describe_processing)
    describe_jobs("media_pipeline.video_finish", kind="Video", describe=describe_finishes)
    describe_jobs(
        "media_pipeline.rendition_transcode", kind="Rendition", describe=describe_transcodes
    )
