"""Cancel through the API the job a user holds for a video (POST /api/videos/'s job_id) while
ffmpeg runs: the processing job had ended as soon as it fanned out the renditions, so it reads
waiting_children, and cancelling it stops what has not finished (202, ffmpeg gone within 5 s,
partial files removed); it then reads cancelled in "My jobs" and the status API, and a second
cancel, with nothing left to stop, is 409. The videos API's own cancel route does the same.
Real worker, real ffmpeg, real PostgreSQL and Redis."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from jobs.models import Job, JobState
from media_pipeline.models import Rendition, RenditionStatus, Video, VideoStatus
from tests.conftest import wait_until
from tests.media_pipeline.conftest import make_clip, upload_file
from tests.media_pipeline.test_cancel import CLIP_SECONDS, STOP_WITHIN, alive, ffmpeg_encoders


@pytest.fixture
def user(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("api-cutter", password="not-used-here")


def transcoding(client: Any, worker: Any, source: Path) -> tuple[dict[str, Any], Video, dict]:
    """A 1080p transcode under way through POST /api/videos/: (accepted, video, encoders)."""
    accepted = client.post("/api/videos/", {"file": upload_file(source), "formats": "1080p"})
    assert accepted.status_code == 202, accepted.content
    video = Video.objects.get(id=accepted.json()["video_id"])
    wait_until(
        lambda: Rendition.objects.filter(video=video, progress__gt=0).exists(),
        timeout=60,
        what="the transcode to be under way",
    )
    encoders = wait_until(
        lambda: ffmpeg_encoders(set(worker.pool_pids())), what="ffmpeg among the pool's children"
    )
    return accepted.json(), video, encoders


def test_cancelling_the_uploads_job_while_ffmpeg_runs_stops_it(
    worker, shared_media, client, user, tmp_path
):
    # given the job POST /api/videos/ answered with, while its 1080p transcode runs
    source = make_clip(tmp_path / "long.mp4", size=(640, 360), seconds=CLIP_SECONDS)
    client.force_login(user)
    accepted, video, encoders = transcoding(client, worker, source)
    job_url = f"/api/jobs/{accepted['job_id']}/"
    folder = Path(settings.MEDIA_ROOT) / video.folder / "renditions"
    # the processing job has run: it reads as waiting on its children, not succeeded
    assert Job.objects.get(id=accepted["job_id"]).state == JobState.SUCCEEDED
    assert client.get(job_url).json()["state"] == "waiting_children"

    # when the user cancels that job
    pressed = time.monotonic()
    response = client.post(f"/api/jobs/{accepted['job_id']}/cancel")

    # then 202, ffmpeg is gone within 5 s, the video is cancelled, no partial file is left
    assert response.status_code == 202, response.content
    assert response.json()["state"] == "cancelled"
    wait_until(
        lambda: not any(alive(pid) for pid in encoders),
        timeout=STOP_WITHIN,
        interval=0.05,
        what="ffmpeg to be gone",
    )
    print(f"\nffmpeg gone {time.monotonic() - pressed:.2f} s after the API's cancel")
    rendition = Rendition.objects.get(video=video)
    wait_until(
        lambda: Job.objects.get(id=str(rendition.job_id)).state == JobState.CANCELLED,
        what="the transcode job to be cancelled",
    )
    wait_until(lambda: not list(folder.glob(".1080p.*.part")), what="the partial file removed")
    video.refresh_from_db()
    rendition.refresh_from_db()
    assert video.status == VideoStatus.CANCELLED
    assert rendition.status == RenditionStatus.CANCELLED
    # "My jobs" and the status API say cancelled for the job the user holds
    assert client.get(job_url).json()["state"] == "cancelled"
    listed = {item["job_id"]: item for item in client.get("/api/jobs/").json()["items"]}
    assert listed[accepted["job_id"]]["state"] == "cancelled"
    page = client.get("/jobs/").content.decode()
    row = page[page.index(f'href="/jobs/{accepted["job_id"]}/"') :]
    assert 'data-field="state">cancelled<' in row[: row.index("</tr>")]
    # and with nothing left to stop, a second cancel is 409
    again = client.post(f"/api/jobs/{accepted['job_id']}/cancel")
    assert again.status_code == 409
    assert client.post(f"/api/videos/{video.id}/cancel").status_code == 409


def test_the_videos_cancel_route_stops_a_running_transcode(
    worker, shared_media, client, user, tmp_path
):
    source = make_clip(tmp_path / "long.mp4", size=(640, 360), seconds=CLIP_SECONDS)
    client.force_login(user)
    accepted, video, encoders = transcoding(client, worker, source)

    response = client.post(f"/api/videos/{video.id}/cancel")
    again = client.post(f"/api/videos/{video.id}/cancel")

    assert response.status_code == 202, response.content
    assert response.json()["state"] == "cancelled"
    # asked again while the stop is under way: nothing more to stop (it was 202 twice)
    assert again.status_code == 409, again.content
    wait_until(
        lambda: not any(alive(pid) for pid in encoders),
        timeout=STOP_WITHIN,
        interval=0.05,
        what="ffmpeg to be gone",
    )
    assert client.get(f"/api/jobs/{accepted['job_id']}/").json()["state"] == "cancelled"


def test_a_job_whose_work_has_ended_is_still_409(worker, shared_media, client, user, tmp_path):
    source = make_clip(tmp_path / "short.mp4", size=(320, 180), seconds=2.0)
    client.force_login(user)
    accepted = client.post("/api/videos/", {"file": upload_file(source), "formats": "360p"})
    video_id = accepted.json()["video_id"]
    wait_until(
        lambda: Video.objects.get(id=video_id).status == VideoStatus.READY,
        timeout=120,
        what="the video to be ready",
    )
    job_id = accepted.json()["job_id"]
    wait_until(
        lambda: client.get(f"/api/jobs/{job_id}/").json()["state"] == "succeeded",
        what="its job to read succeeded (children ended)",
    )
    response = client.post(f"/api/jobs/{job_id}/cancel")
    assert response.status_code == 409
    assert response.json()["state"] == "succeeded"
    assert client.post(f"/api/videos/{video_id}/cancel").status_code == 409
