"""The operators' cockpit in a real browser: replay a dead letter, watch the dashboard move.

Playwright drives Debian's chromium (never `playwright install`); `make test` apt-installs it.
Without /usr/bin/chromium this test fails, it never skips. Screenshots of every step go to
.data/test-artifacts/browser/ and stay there after the run.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connections
from django.utils import timezone

from config.celery import app as celery_app
from jobs.broker.queues import queue_keys as broker_queue_keys
from jobs.broker.redis import redis_client
from jobs.models import DeadLetter, DeadLetterStatus
from tests.conftest import ROOT, Worker, wait_until
from tests.support import tasks

try:
    from playwright.sync_api import Page, expect, sync_playwright
except ImportError as exc:  # a collection error, never a skip
    raise ImportError("playwright is missing: run `make venv` (pip install -e '.[dev]')") from exc

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = ROOT / ".data" / "test-artifacts" / "browser"
PASSWORD = "pw-oncall-" + uuid.uuid4().hex[:12]


class Screenshots:
    """Numbered full-page screenshots of one test, kept under ARTIFACTS after the run."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.paths: list[Path] = []
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        for old in ARTIFACTS.glob("*.png"):
            old.unlink()

    def take(self, name: str) -> Path:
        path = ARTIFACTS / f"{len(self.paths) + 1:02d}-{name}.png"
        self.page.wait_for_load_state()  # a click returns once navigation commits, not loads
        self.page.screenshot(path=str(path), full_page=True)
        self.paths.append(path)
        return path


@pytest.fixture
def page(worker: Worker, live_server: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Page]:
    """A chromium page on the live server (which runs against the test database)."""
    if not CHROMIUM.is_file():
        pytest.fail(
            f"{CHROMIUM} is missing: `make test` installs it (apt-get install chromium); "
            "this test needs Debian's chromium and does not skip without it",
            pytrace=False,
        )
    # Playwright's sync API keeps an asyncio loop running in this thread. Django's guard would
    # refuse the test's ORM calls (plain sync calls, so allow them), and while the loop runs
    # they use a connection of their own: close it before the loop stops, or it stays open
    # and blocks dropping the test database.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            context = browser.new_context(
                base_url=live_server.url, viewport={"width": 1400, "height": 900}
            )
            context.set_default_timeout(10_000)
            yield context.new_page()
        finally:
            browser.close()
            connections.close_all()


@pytest.fixture
def shots(
    page: Page, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> Iterator[Screenshots]:
    """Screenshots of the test's steps (and of the page it failed on), listed at the end."""
    screenshots = Screenshots(page)
    failed_before = request.session.testsfailed
    yield screenshots
    if request.session.testsfailed > failed_before:
        screenshots.take("failure")
    with capsys.disabled():
        print("\nbrowser screenshots:", *screenshots.paths, sep="\n  ")


@pytest.fixture
def reports_unconsumed(worker: Worker) -> Iterator[None]:
    """Nothing takes jobs off `reports` during the test, so its waiting count only grows.

    The session worker leaves `reports` alone, but tests/reports starts a session-scoped
    worker on it that lives until the end of a full run: pause its consumer, and give the
    queue back (emptied) afterwards.
    """

    def consumers() -> list[str]:
        replies = celery_app.control.inspect(timeout=1.0).active_queues() or {}
        return [
            name
            for name, queues in replies.items()
            if any(queue["name"] == "reports" for queue in queues)
        ]

    holders = consumers()
    if holders:
        celery_app.control.cancel_consumer("reports", destination=holders, reply=True, timeout=5)
        wait_until(
            lambda: not consumers(), timeout=15, interval=0.1, what="`reports` consumers to pause"
        )
    yield
    redis_client().delete(*broker_queue_keys("reports"))
    if holders:
        celery_app.control.add_consumer("reports", destination=holders, reply=True, timeout=5)


@pytest.fixture
def operator(django_user_model: Any) -> Any:
    return django_user_model.objects.create_superuser("oncall", "oncall@example.com", PASSWORD)


def dead_letter_that_will_succeed() -> DeadLetter:
    now = timezone.now()
    return DeadLetter.objects.create(
        job_id_value=uuid.uuid4(),
        task_name="tests.add",
        args=[2, 3],
        kwargs={},
        queue="default",
        exception_class="ConnectionError",
        exception_message="provider outage",
        traceback="Traceback (most recent call last):\n  ConnectionError: provider outage",
        first_failed_at=now,
        last_failed_at=now,
        attempts=5,
    )


def test_operator_replays_a_dead_letter_and_watches_the_dashboard(
    page: Page,
    shots: Screenshots,
    operator: Any,
    reports_unconsumed: None,
) -> None:
    row = dead_letter_that_will_succeed()

    # log in
    page.goto("/admin/login/")
    page.fill("#id_username", "oncall")
    page.fill("#id_password", PASSWORD)
    shots.take("login")
    page.get_by_role("button", name="Log in").click()
    expect(page.locator("#user-tools")).to_contain_text("oncall")

    # replay the dead letter from the changelist
    page.goto("/admin/jobs/deadletter/")
    checkbox = page.locator(f'input.action-select[value="{row.pk}"]')
    checkbox.check()
    page.select_option("select[name=action]", label="Replay selected dead letters")
    shots.take("dead-letters")
    page.get_by_role("button", name="Go").click()
    replayed = page.locator("ul.messagelist li.success")
    expect(replayed).to_have_text(re.compile(r"^1 dead letter replayed as [0-9a-f-]{36}\.$"))
    # the message links the new job (issue 25)
    expect(replayed.get_by_role("link")).to_have_attribute(
        "href", re.compile(r"^/admin/jobs/job/[0-9a-f-]{36}/change/$")
    )
    shots.take("replayed")

    # its detail page links the new job, which the session worker runs to success
    page.locator("#result_list").get_by_role("link", name="tests.add").click()
    expect(page).to_have_url(re.compile(rf"/admin/jobs/deadletter/{row.pk}/change/$"))
    shots.take("dead-letter-detail")
    page.locator(".field-replayed_as a").click()
    row.refresh_from_db()
    assert row.status == DeadLetterStatus.REPLAYED
    expect(page).to_have_url(re.compile(rf"/admin/jobs/job/{row.replayed_job_id}/change/$"))
    state = page.locator(".field-state .readonly")

    def shows_succeeded() -> bool:
        page.reload()
        return state.inner_text().strip().lower() == "succeeded"

    wait_until(
        shows_succeeded, timeout=20, interval=0.5, what="the replayed job's page to say succeeded"
    )
    shots.take("job-succeeded")

    # the dashboard, reached from the admin index, follows the `reports` queue by itself
    page.goto("/admin/")
    page.get_by_role("link", name="Jobs dashboard").click()
    expect(page).to_have_url(re.compile(r"/admin/jobs/job/dashboard/$"))
    waiting = page.locator('tr[data-queue="reports"] .waiting')
    before = int(waiting.inner_text())
    shots.take("dashboard-before")

    for n in range(3):
        tasks.prioritized.enqueue("k", f"x{n}")  # no worker takes `reports` now

    expect(waiting).to_have_text(str(before + 3), timeout=15_000)  # no reload: the page polls
    shots.take("dashboard-after")
