"""Admin for videos and renditions: read-only history that renders."""

from __future__ import annotations

import pytest

from media_pipeline.models import Rendition, VideoStatus
from tests.media_pipeline.conftest import video_factory

pytestmark = pytest.mark.django_db


def test_video_and_rendition_admin_render_read_only(admin_client, admin_user):
    video = video_factory(
        owner=admin_user,
        formats=("360p", "720p"),
        status=VideoStatus.FAILED,
        error="720p failed: ffmpeg exited with status 187: <invalid width x height>",
    )
    rendition = Rendition.objects.get(video=video, format="720p")

    pages = {
        "/admin/media_pipeline/video/": 200,
        f"/admin/media_pipeline/video/{video.id}/change/": 200,
        "/admin/media_pipeline/rendition/": 200,
        f"/admin/media_pipeline/rendition/{rendition.pk}/change/": 200,
        "/admin/media_pipeline/video/add/": 403,
    }
    for url, status in pages.items():
        assert admin_client.get(url).status_code == status, url
    detail = admin_client.get(f"/admin/media_pipeline/video/{video.id}/change/").content.decode()
    assert "&lt;invalid width x height&gt;" in detail  # the error is escaped, in <pre>
    assert 'name="_save"' not in detail
