"""The dead-letter list fits a 1,280 px window (issue 25 item 6): in Debian's chromium, with a
dead letter whose message and arguments are long, every column of the changelist (queue,
attempts, failed at, status included) is inside the window and the page does not scroll
sideways."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections
from django.utils import timezone

from jobs.models import DeadLetter
from tests.system.test_browser import CHROMIUM, CHROMIUM_ARGS

pytestmark = pytest.mark.django_db(transaction=True)

WIDTH = 1280


@pytest.fixture
def narrow_page(live_server: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    if not CHROMIUM.is_file():
        pytest.fail(f"{CHROMIUM} is missing (apt-get install chromium)", pytrace=False)
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            context = browser.new_context(
                base_url=live_server.url, viewport={"width": WIDTH, "height": 900}
            )
            context.set_default_timeout(10_000)
            yield context.new_page()
        finally:
            browser.close()
            connections.close_all()


def test_the_dead_letter_list_fits_1280_px(narrow_page, admin_user, clean_redis):
    now = timezone.now()
    DeadLetter.objects.create(
        job_id_value=uuid.uuid4(),
        task_name="media_pipeline.rendition_transcode",
        args=[123456],
        kwargs={"to": "someone.with.a.long.address@example.com", "note": "x" * 300},
        queue="media",
        exception_class="media_pipeline.exceptions.TranscodeFailed",
        exception_message="ffmpeg exited with status 1: " + "Invalid data found " * 20,
        traceback="Traceback (most recent call last):\n  boom",
        first_failed_at=now,
        last_failed_at=now,
    )
    page = narrow_page
    admin_user.set_password("layout-pw-123")
    admin_user.save()
    page.goto("/admin/login/?next=/admin/jobs/deadletter/")
    page.fill("#id_username", admin_user.username)
    page.fill("#id_password", "layout-pw-123")
    page.get_by_role("button", name="Log in").click()
    page.wait_for_selector("#result_list")

    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    headers = page.evaluate(
        """() => [...document.querySelectorAll('#result_list thead th')].map(th => ({
            name: th.className, right: th.getBoundingClientRect().right,
            width: th.getBoundingClientRect().width}))"""
    )
    outside = [h["name"] for h in headers if h["right"] > WIDTH]
    last = max(h["right"] for h in headers)
    print(f"\nsideways overflow {overflow} px; last column ends at {last:.0f} px of {WIDTH}")
    assert overflow <= 0 and not outside
    for column in ("column-queue", "column-attempts", "column-last_failed_at", "column-status"):
        assert any(column in h["name"] for h in headers), column
