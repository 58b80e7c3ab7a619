"""The videos API without a worker: validation, limits, authentication and visibility."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from jobs.models import Job
from media_pipeline.models import Video, VideoStatus
from tests.media_pipeline.conftest import upload_file, video_factory
from web.models import ApiToken

pytestmark = pytest.mark.django_db


@pytest.fixture
def user(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("maria", password="not-used-here")


@pytest.fixture
def other(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("olaf", password="not-used-here")


# The ledger's rows when the test began: a worker test earlier in this process can leave its
# session worker finishing a job (and writing its row) after that test's flush, so "nothing
# enqueued" is "no row the request wrote", not "an empty table".
_JOBS_BEFORE: set[Any] = set()


@pytest.fixture(autouse=True)
def jobs_before(db: None) -> None:
    _JOBS_BEFORE.clear()
    _JOBS_BEFORE.update(Job.objects.values_list("id", flat=True))


def nothing_stored(media: Path) -> bool:
    files = [p for p in media.rglob("*") if p.is_file()] if media.exists() else []
    new_jobs = Job.objects.exclude(id__in=_JOBS_BEFORE)
    return not files and not Video.objects.exists() and not new_jobs.exists()


def test_upload_is_accepted_with_ids_and_status_url(tmp_media, client, user, clip):
    client.force_login(user)

    response = client.post(
        "/api/videos/", {"file": upload_file(clip), "formats": ["1080p", "360p"]}
    )

    assert response.status_code == 202, response.content
    body = response.json()
    video = Video.objects.get(id=body["video_id"])
    assert video.owner == user and str(video.job_id) == body["job_id"]
    assert sorted(r.format for r in video.renditions.all()) == ["1080p", "360p"]
    assert body["status_url"] == f"/api/videos/{video.id}/"
    assert body["job_status_url"] == f"/api/jobs/{video.job_id}/"
    status = client.get(body["status_url"]).json()
    assert status["state"] == "queued" and status["progress"]["percent"] == 0
    assert [r["format"] for r in status["renditions"]] == ["360p", "1080p"]


def test_a_bearer_token_works_like_a_session(tmp_media, client, user, clip):
    _, key = ApiToken.issue(user=user, name="uploader")

    response = client.post(
        "/api/videos/", {"file": upload_file(clip)}, HTTP_AUTHORIZATION=f"Bearer {key}"
    )

    assert response.status_code == 202
    assert Video.objects.get().renditions.count() == 3  # formats left out: all of them


def test_anonymous_upload_is_refused_and_nothing_stored(tmp_media, client, clip):
    response = client.post("/api/videos/", {"file": upload_file(clip), "formats": "360p"})

    assert response.status_code == 401
    assert nothing_stored(tmp_media)


@pytest.mark.parametrize(
    ("formats", "message"),
    [
        (["720p", "4k"], "formats: unknown format '4k'; choose from 360p, 720p, 1080p"),
        ("", "formats: choose at least one of 360p, 720p, 1080p"),
        ("720p,../../x", "formats: unknown format '../../x'"),
    ],
)
def test_a_bad_format_is_400_naming_the_field_and_nothing_is_enqueued(
    tmp_media, client, user, clip, formats, message
):
    client.force_login(user)

    response = client.post("/api/videos/", {"file": upload_file(clip), "formats": formats})

    assert response.status_code == 400
    assert response.json()["detail"].startswith(message)
    assert nothing_stored(tmp_media)


def test_an_empty_file_is_400(tmp_media, client, user):
    client.force_login(user)

    response = client.post("/api/videos/", {"file": SimpleUploadedFile("empty.mp4", b"")})

    assert response.status_code == 400 and response.json()["detail"] == "file: the file is empty"
    assert nothing_stored(tmp_media)


@pytest.mark.parametrize(
    "size",
    [
        200_000,  # the declared body length is over the limit: refused before it is read
        5_000,  # within the framing allowance: the parse stops when the file passes the limit
    ],
)
def test_an_oversized_upload_is_413_and_nothing_is_stored(tmp_media, settings, client, user, size):
    settings.BACKLOT_MAX_UPLOAD_BYTES = 1000
    client.force_login(user)

    response = client.post(
        "/api/videos/", {"file": SimpleUploadedFile("big.mp4", b"\0" * size), "formats": "360p"}
    )

    assert response.status_code == 413
    assert "uploads are limited to 1000 bytes" in response.json()["detail"]
    assert nothing_stored(tmp_media)


def test_a_file_of_exactly_the_limit_is_accepted(tmp_media, settings, client, user, clip):
    settings.BACKLOT_MAX_UPLOAD_BYTES = clip.stat().st_size
    client.force_login(user)

    response = client.post("/api/videos/", {"file": upload_file(clip), "formats": "360p"})

    assert response.status_code == 202


def test_another_users_video_is_404_and_staff_see_it(client, user, other, admin_user):
    video = video_factory(owner=user, status=VideoStatus.READY)
    url = f"/api/videos/{video.id}/"

    client.force_login(other)
    assert client.get(url).status_code == 404
    assert client.get("/api/videos/").json() == []
    assert client.get("/api/videos/not-a-uuid/").status_code == 404

    client.force_login(user)
    assert client.get(url).json()["state"] == "ready"
    assert [v["video_id"] for v in client.get("/api/videos/").json()] == [str(video.id)]

    client.force_login(admin_user)
    assert client.get(url).status_code == 200


def test_status_needs_authentication(client, user):
    video = video_factory(owner=user)

    assert client.get(f"/api/videos/{video.id}/").status_code == 401
