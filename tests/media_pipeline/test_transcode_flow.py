"""Upload to ready on a real worker: renditions probed, progress polled, failures dead-lettered."""

from __future__ import annotations

import os
import signal
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile

from jobs.models import DeadLetter, Job, JobState
from media_pipeline.models import Rendition, RenditionStatus, Video
from tests.conftest import wait_until
from tests.media_pipeline.conftest import CLIP_SECONDS, make_clip, upload_file

EXPECTED_SIZES = {"360p": (640, 360), "720p": (1280, 720), "1080p": (1920, 1080)}
# Upload to ready for the 3 s clip takes ~4 s on 2 cores; the bound is for a loaded CI host.
FLOW_TIMEOUT = 120


@pytest.fixture
def user(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("maria", password="not-used-here")


def poll(
    client: Any, url: str, *, timeout: float = FLOW_TIMEOUT, interval: float = 0.05
) -> list[dict]:
    """GET the status URL until the video settles; every answer, in order."""
    answers = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = client.get(url)
        assert response.status_code == 200, response.content
        answers.append(response.json())
        if answers[-1]["state"] in ("ready", "failed"):
            return answers
        time.sleep(interval)
    raise AssertionError(f"video did not settle in {timeout}s; last answer {answers[-1]}")


def non_decreasing(values: list[float]) -> bool:
    return all(a <= b for a, b in pairwise(values))


def test_upload_becomes_ready_with_probed_renditions_and_rising_progress(
    worker, shared_media, client, user, clip, ffprobe
):
    # given
    client.force_login(user)

    # when
    response = client.post(
        "/api/videos/", {"file": upload_file(clip), "formats": ["360p", "720p", "1080p"]}
    )

    # then: accepted at once
    assert response.status_code == 202, response.content
    accepted = response.json()
    assert set(accepted) == {"video_id", "job_id", "status_url", "job_status_url"}
    assert accepted["status_url"] == f"/api/videos/{accepted['video_id']}/"
    answers = poll(client, accepted["status_url"])

    final = answers[-1]
    assert final["state"] == "ready", final
    assert final["duration"] == pytest.approx(CLIP_SECONDS, abs=0.05)
    # overall progress: polled from 0, only ever rising, to 100, with steps seen in between
    overall = [a["progress"]["percent"] for a in answers]
    assert overall[0] == 0 and overall[-1] == 100 and non_decreasing(overall), overall
    assert any(0 < p < 100 for p in overall), overall
    print(f"\noverall progress seen: {sorted(set(overall))} over {len(answers)} polls")
    for fmt in EXPECTED_SIZES:
        per_format = [
            next(r["progress"] for r in a["renditions"] if r["format"] == fmt) for a in answers
        ]
        assert non_decreasing(per_format) and per_format[-1] == 100, (fmt, per_format)
    assert any(0 < r["progress"] < 100 for a in answers for r in a["renditions"])

    # each rendition is a real file of the right size and length
    video = Video.objects.get(id=accepted["video_id"])
    for rendition in final["renditions"]:
        row = Rendition.objects.get(video=video, format=rendition["format"])
        probed = ffprobe(Path(settings.MEDIA_ROOT) / row.path)
        assert (probed["width"], probed["height"]) == EXPECTED_SIZES[row.format]
        assert rendition["resolution"] == "{}x{}".format(*EXPECTED_SIZES[row.format])
        assert probed["duration"] == pytest.approx(CLIP_SECONDS, abs=0.1)
        assert probed["codec"] == "h264" and probed["audio_codec"] == "aac"
        assert rendition["size_bytes"] == (Path(settings.MEDIA_ROOT) / row.path).stat().st_size
        assert row.finished_at is not None and row.started_at is not None
        seconds = (row.finished_at - row.started_at).total_seconds()
        print(
            f"\n{row.format}: {row.resolution}, {row.size_bytes} bytes, {seconds:.2f}s to transcode"
        )
    assert not list((Path(settings.MEDIA_ROOT) / video.folder).rglob("*.part"))

    # one job per format, each once, and the chord's callback settled the video
    jobs = Job.objects.filter(task_name="media_pipeline.rendition_transcode")
    assert jobs.count() == 3 and all(
        j.state == JobState.SUCCEEDED and j.attempts == 1 for j in jobs
    )
    assert {str(j.id) for j in jobs} == {r["job_id"] for r in final["renditions"]}
    # this video's settling job: the batch callback its own processing job set up
    # (its success is written with others' by its worker, within SUCCESS_BATCH_SECONDS)
    finish = Job.objects.filter(
        task_name="media_pipeline.video_finish", parent_id=accepted["job_id"]
    )
    wait_until(
        lambda: finish.get().state == JobState.SUCCEEDED, timeout=10, what="the settling job"
    )
    assert Job.objects.get(id=accepted["job_id"]).state == JobState.SUCCEEDED

    # the owner downloads a rendition; a player can seek in it
    url = next(r["download_url"] for r in final["renditions"] if r["format"] == "360p")
    content = b"".join(client.get(url).streaming_content)
    assert (
        content == (Path(settings.MEDIA_ROOT) / f"{video.folder}/renditions/360p.mp4").read_bytes()
    )
    ranged = client.get(url, HTTP_RANGE="bytes=100-199")
    assert ranged.status_code == 206 and b"".join(ranged.streaming_content) == content[100:200]
    assert ranged["Content-Range"] == f"bytes 100-199/{len(content)}"


def test_a_file_that_is_not_a_video_fails_once_into_the_dead_letters(
    worker, shared_media, client, user
):
    client.force_login(user)
    junk = SimpleUploadedFile("holiday.mp4", b"these are holiday notes, not a video\n" * 50)

    accepted = client.post("/api/videos/", {"file": junk, "formats": ["720p"]}).json()
    final = poll(client, accepted["status_url"])[-1]

    assert final["state"] == "failed"
    assert "Invalid data found when processing input" in final["error"]
    dead = wait_until(
        lambda: DeadLetter.objects.filter(job_id_value=accepted["job_id"]).first(),
        what="the dead letter",
    )
    assert dead.attempts == 1
    assert dead.exception_class == "media_pipeline.exceptions.NotAVideo"
    assert "Invalid data found when processing input" in dead.exception_message
    job = Job.objects.get(id=accepted["job_id"])
    assert job.state == JobState.DEAD and job.attempts == 1
    # nothing was retried and no transcode was started
    assert not Job.objects.filter(task_name="media_pipeline.rendition_transcode").exists()
    assert final["renditions"] == [
        {
            "format": "720p",
            "state": "queued",
            "progress": 0,
            "width": None,
            "height": None,
            "resolution": None,
            "duration": None,
            "size_bytes": None,
            "error": None,
            "job_id": None,
            "download_url": None,
            "poster_url": None,
        }
    ]


def test_a_failed_format_fails_the_video_and_names_it(
    worker, shared_media, client, user, wide_clip
):
    # given a 20:1 picture: its 1080p (21600 px wide) is past x264's limit, its 360p is not
    client.force_login(user)

    accepted = client.post(
        "/api/videos/", {"file": upload_file(wide_clip), "formats": "360p,1080p"}
    ).json()
    final = poll(client, accepted["status_url"])[-1]

    assert final["state"] == "failed"
    assert final["error"].startswith("1080p failed: ffmpeg exited with status")
    assert "360p" not in final["error"]
    by_format = {r["format"]: r for r in final["renditions"]}
    assert by_format["360p"]["state"] == "ready" and by_format["360p"]["download_url"]
    assert by_format["1080p"]["state"] == "failed" and by_format["1080p"]["download_url"] is None
    dead = DeadLetter.objects.get(job_id_value=by_format["1080p"]["job_id"])
    assert dead.exception_class == "media_pipeline.exceptions.TranscodeFailed"
    assert dead.attempts == 1  # an encoder that refuses the size will refuse it again
    assert "21600x1080" in dead.exception_message
    # the chord's errback settled it: the same settling job, run once
    # this video's settling job: the batch callback its own processing job set up
    # (its success is written with others' by its worker, within SUCCESS_BATCH_SECONDS)
    finish = Job.objects.filter(
        task_name="media_pipeline.video_finish", parent_id=accepted["job_id"]
    )
    wait_until(
        lambda: finish.get().state == JobState.SUCCEEDED, timeout=10, what="the settling job"
    )


def ffmpeg_writing(folder: Path) -> dict[int, int]:
    """ffmpeg processes writing into `folder`: {pid: parent pid}."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        if str(folder) in cmdline and ".part" in cmdline:
            found[int(proc.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return found


def test_a_worker_killed_mid_transcode_records_nothing_half_written(
    worker, shared_media, client, user, tmp_path, ffprobe
):
    # given a transcode long enough to kill in the middle (~5 s for 1080p of a 6 s clip)
    source = make_clip(tmp_path / "long.mp4", size=(640, 360), seconds=6.0)
    client.force_login(user)
    accepted = client.post("/api/videos/", {"file": upload_file(source), "formats": "1080p"}).json()
    video = Video.objects.get(id=accepted["video_id"])
    folder = Path(settings.MEDIA_ROOT) / video.folder / "renditions"
    wait_until(
        lambda: Rendition.objects.filter(video=video, progress__gt=0).exists(),
        timeout=60,
        what="the transcode to be under way",
    )
    encoders = wait_until(lambda: ffmpeg_writing(folder), what="ffmpeg to be found")

    # when the pool process running it dies (an OOM kill)
    for pool_pid in set(encoders.values()):
        os.kill(pool_pid, signal.SIGKILL)

    # then its ffmpeg dies with it, nothing is recorded as done, and the retry finishes the job
    assert not (folder / "1080p.mp4").exists()
    assert Rendition.objects.get(video=video).status != RenditionStatus.READY
    wait_until(
        lambda: not set(encoders) & set(ffmpeg_writing(folder)),
        timeout=5,
        what="the orphaned ffmpeg to exit",
    )
    final = poll(client, accepted["status_url"])[-1]
    assert final["state"] == "ready"
    job = Job.objects.get(id=final["renditions"][0]["job_id"])
    assert job.state == JobState.SUCCEEDED and job.crashes == 1
    assert sorted(p.name for p in folder.iterdir()) == ["1080p.jpg", "1080p.mp4"]  # and its poster
    assert ffprobe(folder / "1080p.mp4")["duration"] == pytest.approx(6.0, abs=0.1)
