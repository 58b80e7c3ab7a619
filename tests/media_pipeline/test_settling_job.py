"""The settling job (video_finish, the renditions' batch callback) takes its video with it:
dead-lettered, the video ends failed with the reason; cancelled, it ends cancelled."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from jobs.models import Job, JobState
from media_pipeline.models import Rendition, RenditionStatus, Video, VideoStatus
from media_pipeline.tasks import video_finish_job
from tests.conftest import wait_until
from tests.media_pipeline.conftest import upload_file
from tests.support.refusals import status_refused


@pytest.fixture
def user(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("settler", password="not-used-here")


def test_a_settling_job_that_dies_fails_its_video_with_the_reason(
    worker, shared_media, client, user, clip: Path
):
    client.force_login(user)
    # given a database that refuses to mark any video ready: the settling job's write fails
    with status_refused(Video, VideoStatus.READY):
        # when a real upload is transcoded and its batch callback settles it
        accepted = client.post("/api/videos/", {"file": upload_file(clip), "formats": "360p"})
        assert accepted.status_code == 202, accepted.content
        video_id = accepted.json()["video_id"]
        # then the video reads failed, with the reason, once the settling job is dead
        body = wait_until(
            lambda: (b := client.get(f"/api/videos/{video_id}/").json())["state"] == "failed" and b,
            timeout=120,
            what="the video to fail",
        )
    [settling] = Job.objects.filter(task_name="media_pipeline.video_finish")
    assert settling.state == JobState.DEAD and settling.args[1] == video_id  # (batch, video)
    assert body["error"].startswith("the settling job gave up: IntegrityError: ")
    assert [r["state"] for r in body["renditions"]] == ["ready"]  # the written format stays


def test_cancelling_a_waiting_settling_job_cancels_its_video(worker, client, user):
    # given a video whose formats are written and whose settling job waits (as a batch's
    # callback: the batch id first, then the video id)
    video = Video.objects.create(
        owner=user, original_name="clip.mp4", status=VideoStatus.TRANSCODING
    )
    Rendition.objects.create(video=video, format="360p", status=RenditionStatus.READY)
    handle = video_finish_job.using(owner=user, delay=600).enqueue(str(uuid.uuid4()), str(video.id))
    client.force_login(user)

    # when it is cancelled through the jobs API
    response = client.post(f"/api/jobs/{handle.id}/cancel")

    # then the video reads cancelled (the hook took the batch id for the video's before)
    assert response.status_code == 202, response.content
    assert client.get(f"/api/jobs/{handle.id}/").json()["state"] == "cancelled"
    assert client.get(f"/api/videos/{video.id}/").json()["state"] == "cancelled"
