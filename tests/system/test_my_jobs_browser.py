"""The browser walk of "My jobs" with a campaign and a video (issue 25 item 6), in Debian's
chromium through Playwright, against a real worker, the real SMTP server and real ffmpeg: a
campaign of 12 reads as one row named after it, linking its page, with its sends counted under
it; a video uploaded while the page is open appears on top named after its file, with its
renditions listed under it, and every state moves to its end without a reload; the kind filter
keeps the video's jobs only, and the video's name leads to its page."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connections

from emails import services as email_services
from emails.tasks import campaign_fan_out_job
from jobs.models import Job
from tests.media_pipeline.conftest import make_clip, shared_media, upload_file  # noqa: F401
from tests.system.test_browser import CHROMIUM, CHROMIUM_ARGS

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("shared_media")]

RECIPIENTS = 12  # more than jobs.web.listing.CHILDREN_LISTED: the sends are counted, not listed
# A campaign's 12 sends and two 1-second transcodes on a shared 2-core machine: well under this.
DONE_WITHIN_MS = 90_000


@pytest.fixture
def page(live_server: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    if not CHROMIUM.is_file():
        pytest.fail(f"{CHROMIUM} is missing (apt-get install chromium)", pytrace=False)
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # see tests/system/test_browser.py
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            context = browser.new_context(
                base_url=live_server.url, viewport={"width": 1280, "height": 900}
            )
            context.set_default_timeout(10_000)
            yield context.new_page()
        finally:
            browser.close()
            connections.close_all()


def test_my_jobs_with_a_campaign_and_a_video(
    worker: Any, mailbox: Any, page: Any, client: Any, django_user_model: Any, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    # given: a campaign of 12 started, and the user on "My jobs"
    user = django_user_model.objects.create_user("walker", password="pw-walker-123")
    campaign = email_services.campaign_create(
        name="Spring sale",
        template="campaign",
        context={"headline": "Spring", "body": "Hello"},
        owner=user,
        recipients=[{"email": f"w{n}@example.com"} for n in range(RECIPIENTS)],
    )
    started = email_services.campaign_start(
        campaign=campaign, owner=user, fan_out_job=campaign_fan_out_job
    )
    page.goto("/accounts/login/?next=/jobs/")
    page.fill("#id_username", "walker")
    page.fill("#id_password", "pw-walker-123")
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_selector("h1:has-text('My jobs')")
    page.evaluate("window.sameDocument = true")  # gone if the page were reloaded

    # then: the campaign is one row, named after it and linking its page, its sends counted
    fan_out = page.locator(f'tr.job[data-job-id="{started.id}"]')
    name = fan_out.locator('[data-field="label"]')
    expect(name).to_have_text("Spring sale")
    expect(name).to_have_attribute("href", f"/emails/campaigns/{campaign.pk}/")
    expect(fan_out.locator(".kind")).to_have_text("Campaign")
    sends = page.locator(f'tr[data-children-of="{started.id}"] [data-field="count"]')
    expect(sends).to_have_text(
        f"Email ({RECIPIENTS}): {RECIPIENTS} succeeded", timeout=DONE_WITHIN_MS
    )
    expect(fan_out.locator('[data-field="state"]')).to_have_text("succeeded")
    assert page.locator('tr.job:has-text("emails.send ·")').count() == 0
    assert len(mailbox.received()) == RECIPIENTS

    # when: a video is uploaded while the page stays open
    client.force_login(user)
    clip = make_clip(tmp_path / "walk.mp4", size=(1280, 720), seconds=1)
    accepted = client.post("/api/videos/", {"file": upload_file(clip), "formats": "360p,720p"})
    assert accepted.status_code == 202, accepted.content
    video_id, job_id = accepted.json()["video_id"], accepted.json()["job_id"]

    # then: it appears on top, named after its file, its renditions listed under it, and each
    # state moves to its end without a reload
    top = page.locator("tbody tr.job").first
    expect(top).to_have_attribute("data-job-id", job_id, timeout=20_000)
    video_name = top.locator('[data-field="label"]')
    expect(video_name).to_have_text("walk.mp4")
    expect(video_name).to_have_attribute("href", f"/videos/{video_id}/")
    members = page.locator(f'tr[data-children-of="{job_id}"] li')
    expect(members.locator('[data-field="label"]')).to_have_text(
        ["360p of walk.mp4", "720p of walk.mp4", "walk.mp4: finish"], timeout=DONE_WITHIN_MS
    )
    expect(members.locator('[data-field="state"]')).to_have_text(
        ["succeeded", "succeeded", "succeeded"], timeout=DONE_WITHIN_MS
    )
    expect(top.locator('[data-field="state"]')).to_have_text("succeeded")
    assert page.evaluate("window.sameDocument === true")
    children = Job.objects.filter(parent_id=job_id).count()
    assert children == 3  # the two transcodes and the job that settles the video

    # when: the kind filter asks for videos
    page.select_option("#filter-kind", "Video")
    page.get_by_role("button", name="Filter").click()

    # then: the video's jobs only (its settling job too: a kind is listed wherever it sits)
    expect(page.locator("#filter-kind")).to_have_value("Video")
    listed = page.locator("tbody tr.job")
    expect(listed).to_have_count(2)
    expect(listed.locator(".kind")).to_have_text(["Video", "Video"])
    assert page.locator(f'tr.job[data-job-id="{started.id}"]').count() == 0

    # and the video's name leads to its page
    page.locator(f'tr.job[data-job-id="{job_id}"] [data-field="label"]').click()
    page.wait_for_url(f"**/videos/{video_id}/")
    expect(page.get_by_text("walk.mp4").first).to_be_visible()
