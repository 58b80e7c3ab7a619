"""Cancel a running transcode on a real worker with real ffmpeg: ffmpeg is gone within 5 s,
even while it writes no progress; nothing is recorded as written; no partial file is left."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from jobs.models import DeadLetter, Job, JobState
from media_pipeline.models import Rendition, RenditionStatus, Video, VideoStatus
from tests.conftest import wait_until
from tests.media_pipeline.conftest import make_clip, upload_file

# 1080p of a 20 s clip takes ~15 s on 2 cores: long enough to be cancelled in the middle.
CLIP_SECONDS = 20.0
# What a user may wait for the encoder to stop after pressing Cancel.
STOP_WITHIN = 5.0


@pytest.fixture
def user(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("cutter", password="not-used-here")


def ffmpeg_encoders(parents: set[int]) -> dict[int, int]:
    """Live ffmpeg transcodes (they write a .part file) started by `parents`: {pid: parent}."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        state, parent = fields[0], int(fields[1])
        if parent in parents and "ffmpeg" in cmdline and ".part" in cmdline and state != "Z":
            found[int(proc.name)] = parent
    return found


def alive(pid: int) -> bool:
    """Exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_cancel_stops_a_running_transcode_and_leaves_nothing_half_written(
    worker, shared_media, client, user, tmp_path
):
    # given a 1080p transcode under way, its ffmpeg found among the worker's pool processes
    source = make_clip(tmp_path / "long.mp4", size=(640, 360), seconds=CLIP_SECONDS)
    client.force_login(user)
    accepted = client.post("/api/videos/", {"file": upload_file(source), "formats": "1080p"})
    assert accepted.status_code == 202, accepted.content
    video = Video.objects.get(id=accepted.json()["video_id"])
    folder = Path(settings.MEDIA_ROOT) / video.folder / "renditions"
    wait_until(
        lambda: Rendition.objects.filter(video=video, progress__gt=0).exists(),
        timeout=60,
        what="the transcode to be under way",
    )
    encoders = wait_until(
        lambda: ffmpeg_encoders(set(worker.pool_pids())), what="ffmpeg among the pool's children"
    )
    assert list(folder.glob(".1080p.*.part")), "ffmpeg writes a partial file"
    page = client.get(f"/videos/{video.id}/")
    assert 'id="cancel"' in page.content.decode()
    # ffmpeg stalls: it writes no progress line now, so only a terminating cancel can stop it
    for pid in encoders:
        os.kill(pid, signal.SIGSTOP)

    # when its owner presses Cancel on the video's page
    pressed = time.monotonic()
    response = client.post(f"/videos/{video.id}/cancel", follow=True)

    # then ffmpeg is gone within 5 s
    assert response.status_code == 200
    assert "Cancelled" in response.content.decode()
    wait_until(
        lambda: not any(alive(pid) for pid in encoders),
        timeout=STOP_WITHIN,
        interval=0.05,
        what="ffmpeg to be gone",
    )
    print(f"\nffmpeg gone {time.monotonic() - pressed:.2f} s after Cancel")
    # the video is cancelled, no rendition is ready, no partial file is left
    rendition = Rendition.objects.get(video=video)
    job_id = str(rendition.job_id)
    wait_until(lambda: Job.objects.get(id=job_id).state == JobState.CANCELLED, what="the job")
    wait_until(
        lambda: not list(folder.glob(".1080p.*.part")), what="the partial file to be removed"
    )
    video.refresh_from_db()
    rendition.refresh_from_db()
    assert video.status == VideoStatus.CANCELLED and video.finished_at is not None
    assert rendition.status == RenditionStatus.CANCELLED and not rendition.path
    assert not Rendition.objects.filter(video=video, status=RenditionStatus.READY).exists()
    assert sorted(p.name for p in folder.iterdir()) == []
    assert not DeadLetter.objects.filter(job_id_value=job_id).exists()
    status = client.get(accepted.json()["status_url"]).json()
    assert status["state"] == "cancelled" and status["renditions"][0]["state"] == "cancelled"
    # pressing it again says it already finished
    again = client.post(f"/videos/{video.id}/cancel", follow=True).content.decode()
    assert "already finished" in again and 'id="cancel"' not in again

    # and the worker goes on: its killed pool process was replaced
    after = client.post("/api/videos/", {"file": upload_file(source), "formats": "360p"}).json()
    wait_until(
        lambda: Video.objects.get(id=after["video_id"]).status == VideoStatus.READY,
        timeout=120,
        what="the next video to be transcoded",
    )
