"""The video page's player plays the formats that finished of a video that failed or was
cancelled: the written rendition is the player's src and loads in a real browser; the failed
format is listed as failed with no download.

Playwright drives Debian's chromium (as tests/system/test_browser.py does; `make test` installs it).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connections
from django.test import Client

from media_pipeline.models import Rendition, RenditionStatus, Video, VideoStatus
from tests.media_pipeline.conftest import video_factory

try:
    from playwright.sync_api import Page, expect, sync_playwright
except ImportError as exc:  # a collection error, never a skip
    raise ImportError("playwright is missing: run `make venv` (pip install -e '.[dev]')") from exc

pytestmark = pytest.mark.django_db(transaction=True)

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"]


@pytest.fixture
def page(live_server: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Page]:
    if not CHROMIUM.is_file():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (apt-get install chromium)")
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            context = browser.new_context(base_url=live_server.url)
            context.set_default_timeout(15_000)
            yield context.new_page()
        finally:
            browser.close()
            connections.close_all()


def settled_video(owner: Any, media: Path, clip: Path, status: str) -> Video:
    """Two formats: 360p written (a real H.264 file), 720p failed."""
    video = video_factory(owner=owner, formats=("360p", "720p"), status=status)
    path = f"{video.folder}/renditions/360p.mp4"
    (media / path).parent.mkdir(parents=True)
    shutil.copyfile(clip, media / path)
    Rendition.objects.filter(video=video, format="360p").update(
        status=RenditionStatus.READY,
        path=path,
        size_bytes=clip.stat().st_size,
        width=640,
        height=360,
        progress=100,
    )
    Rendition.objects.filter(video=video, format="720p").update(
        status=RenditionStatus.FAILED, error="x264 refused the picture", progress=40
    )
    return video


@pytest.mark.parametrize("status", [VideoStatus.FAILED, VideoStatus.CANCELLED])
def test_player_plays_the_finished_format(
    page: Page, live_server: Any, django_user_model: Any, tmp_media: Path, clip: Path, status: str
):
    owner = django_user_model.objects.create_user("maria", password="not-used-here")
    video = settled_video(owner, tmp_media, clip, status)
    client = Client()
    client.force_login(owner)
    cookie = client.cookies[settings.SESSION_COOKIE_NAME]
    page.context.add_cookies([{"name": cookie.key, "value": cookie.value, "url": live_server.url}])
    source = f"/videos/{video.id}/renditions/360p/"

    page.goto(f"/videos/{video.id}/")

    expect(page.locator("#state")).to_have_text(status)
    player = page.locator("video#player")
    expect(player).to_be_visible()
    expect(player).to_have_attribute("src", source)
    # the browser loaded the file: metadata read (readyState >= 1) and its real duration
    page.wait_for_function(
        "() => { const v = document.getElementById('player'); return v.readyState >= 1; }"
    )
    assert page.evaluate("document.getElementById('player').currentSrc") == live_server.url + source
    assert 2.5 < page.evaluate("document.getElementById('player').duration") < 3.5
    assert page.locator("video#player source").count() == 0
    assert "720p" not in (player.get_attribute("src") or "")
    # the failed format is listed as failed, with its error and no download
    failed = page.locator('tr[data-format="720p"]')
    expect(failed.locator(".r-state")).to_have_text("failed")
    expect(failed.locator("a.download")).to_be_hidden()
    expect(page.locator('tr[data-error-for="720p"] .r-error')).to_have_text(
        "x264 refused the picture"
    )
    expect(page.locator('tr[data-format="360p"] .r-state')).to_have_text("ready")
    # the owner's request for the player's source answers 200 with the video
    response = page.request.get(source)
    assert response.status == 200 and response.headers["content-type"] == "video/mp4"
    assert response.body() == clip.read_bytes()
