"""The video pages: list and upload form, a video's live status, rendition downloads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from jobs.models import Job
from media_pipeline.models import Rendition, RenditionStatus, Video, VideoStatus
from tests.media_pipeline.conftest import upload_file, video_factory

pytestmark = pytest.mark.django_db


@pytest.fixture
def user(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("maria", password="not-used-here")


@pytest.fixture
def other(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("olaf", password="not-used-here")


@pytest.fixture
def ready_video(tmp_media: Path, user: Any) -> Video:
    """A ready video whose 360p rendition is a file of known bytes."""
    video = video_factory(owner=user, original_name="beach day.mov", status=VideoStatus.READY)
    path = f"{video.folder}/renditions/360p.mp4"
    (tmp_media / path).parent.mkdir(parents=True)
    (tmp_media / path).write_bytes(bytes(range(256)) * 4)
    Rendition.objects.filter(video=video).update(
        status=RenditionStatus.READY,
        path=path,
        size_bytes=1024,
        width=640,
        height=360,
        progress=100,
    )
    return video


def test_pages_need_a_login(client):
    response = client.get("/videos/")

    assert response.status_code == 302 and response["Location"].startswith(
        "/accounts/login/?next=/videos/"
    )


def test_list_shows_the_form_and_only_the_users_videos(client, user, other):
    video_factory(owner=user, original_name="mine.mp4")
    video_factory(owner=other, original_name="theirs.mp4")
    client.force_login(user)

    page = client.get("/videos/").content.decode()

    assert 'enctype="multipart/form-data"' in page and 'type="file"' in page
    for fmt in ("360p", "720p", "1080p"):
        assert f'type="checkbox" name="formats" value="{fmt}"' in page
    assert "mine.mp4" in page and "theirs.mp4" not in page


def test_upload_through_the_page_redirects_to_the_video(tmp_media, client, user, clip):
    client.force_login(user)

    response = client.post(
        "/videos/", {"file": upload_file(clip, "trip.mp4"), "formats": ["360p", "720p"]}
    )

    video = Video.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/videos/{video.id}/"
    assert sorted(r.format for r in video.renditions.all()) == ["360p", "720p"]
    assert video.job_id is not None
    assert Job.objects.filter(id=video.job_id, task_name="media_pipeline.video_process").exists()
    page = client.get(response["Location"]).content.decode()
    assert "trip.mp4 is uploaded" in page
    assert f'data-video-status-url="/api/videos/{video.id}/"' in page
    assert 'data-format="360p"' in page and 'data-format="720p"' in page


def test_page_upload_without_formats_is_400_and_stores_nothing(tmp_media, client, user, clip):
    client.force_login(user)

    response = client.post("/videos/", {"file": upload_file(clip)})

    assert (
        response.status_code == 400 and "Choose at least one format." in response.content.decode()
    )
    assert not Video.objects.exists() and not tmp_media.exists()


def test_page_upload_over_the_limit_is_413_with_the_reason(tmp_media, settings, client, user):
    settings.BACKLOT_MAX_UPLOAD_BYTES = 1000
    client.force_login(user)

    response = client.post(
        "/videos/", {"file": SimpleUploadedFile("big.mp4", b"\0" * 4000), "formats": "360p"}
    )

    assert response.status_code == 413
    assert "uploads are limited to 1000 bytes" in response.content.decode()
    assert not Video.objects.exists() and not tmp_media.exists()


def test_page_upload_still_checks_csrf(tmp_media, user, clip):
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)

    response = client.post("/videos/", {"file": upload_file(clip), "formats": "360p"})

    assert response.status_code == 403 and not Video.objects.exists()


def test_video_page_is_for_the_owner_and_staff(client, user, other, admin_user):
    video = video_factory(owner=user)

    client.force_login(other)
    assert client.get(f"/videos/{video.id}/").status_code == 404
    client.force_login(admin_user)
    assert client.get(f"/videos/{video.id}/").status_code == 200


def test_rendition_download_for_the_owner_with_byte_ranges(client, user, ready_video):
    client.force_login(user)
    url = f"/videos/{ready_video.id}/renditions/360p/"
    data = bytes(range(256)) * 4

    whole = client.get(url)
    assert whole.status_code == 200 and b"".join(whole.streaming_content) == data
    assert whole["Content-Type"] == "video/mp4" and whole["Accept-Ranges"] == "bytes"
    assert whole["Content-Disposition"] == 'inline; filename="beach day-360p.mp4"'
    assert "private" in whole["Cache-Control"]
    saved = client.get(url + "?download=1")
    assert saved["Content-Disposition"].startswith("attachment;")
    tail = client.get(url, HTTP_RANGE="bytes=-24")
    assert tail.status_code == 206 and b"".join(tail.streaming_content) == data[-24:]
    assert tail["Content-Range"] == "bytes 1000-1023/1024" and tail["Content-Length"] == "24"
    assert client.get(url, HTTP_RANGE="bytes=5000-").status_code == 416


def test_rendition_download_is_404_for_others_and_unfinished_formats(
    client, other, user, ready_video
):
    client.force_login(other)
    assert client.get(f"/videos/{ready_video.id}/renditions/360p/").status_code == 404

    client.force_login(user)
    Rendition.objects.filter(video=ready_video).update(status=RenditionStatus.RUNNING)
    assert client.get(f"/videos/{ready_video.id}/renditions/360p/").status_code == 404
    assert client.get(f"/videos/{ready_video.id}/renditions/4k/").status_code == 404
