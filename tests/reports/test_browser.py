"""The reports pages in a real browser: request a PDF, watch the progress bar, download it.

Playwright drives Debian's chromium (as tests/system/test_browser.py does; `make test` installs
it). Screenshots go to .data/test-artifacts/reports/ and stay there after the run.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connections
from django.test import Client
from django.utils import timezone

from reports.demo import demo_seed
from reports.models import Report, ReportStatus
from tests.conftest import ROOT, Worker
from tests.reports.conftest import grant, pdf_text, remove_report_files

try:
    from playwright.sync_api import Page, expect, sync_playwright
except ImportError as exc:  # a collection error, never a skip
    raise ImportError("playwright is missing: run `make venv` (pip install -e '.[dev]')") from exc

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"]
ARTIFACTS = ROOT / ".data" / "test-artifacts" / "reports"
PASSWORD = "pw-reader-" + uuid.uuid4().hex[:12]


@pytest.fixture
def page(rworker: Worker, live_server: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Page]:
    if not CHROMIUM.is_file():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (apt-get install chromium)")
    # Playwright's sync API runs an asyncio loop in this thread; the test's ORM calls are plain
    # sync calls (allowed), and their connection is closed before the loop stops.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            context = browser.new_context(
                base_url=live_server.url,
                viewport={"width": 1200, "height": 900},
                accept_downloads=True,
            )
            context.set_default_timeout(15_000)
            yield context.new_page()
        finally:
            browser.close()
            remove_report_files()
            connections.close_all()


def shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def sign_in(page: Page, live_server: Any, user: Any) -> None:
    """Hand the browser a session of `user` (a plain user: /admin/login/ admits only staff)."""
    client = Client()
    client.force_login(user)
    cookie = client.cookies[settings.SESSION_COOKIE_NAME]
    page.context.add_cookies([{"name": cookie.key, "value": cookie.value, "url": live_server.url}])


def test_request_watch_and_download_a_report(
    page: Page, live_server: Any, django_user_model: Any, tmp_path: Path
):
    demo_seed(days=120)
    user = django_user_model.objects.create_user("reader", password=PASSWORD)
    sign_in(page, live_server, grant(user, "request_sales_report"))
    today = timezone.localdate()

    page.goto("/reports/")
    expect(page.locator("h1")).to_have_text("Reports")
    # the menu offers the one kind this reader may request
    expect(page.locator("#id_kind option")).to_have_text(["Sales summary"])
    shot(page, "01-reports")

    # request the sales summary of the last 90 days
    page.select_option("#id_kind", "sales")
    page.fill("#id_start", str(today - timedelta(days=89)))
    page.fill("#id_end", str(today))
    page.click("main button[type=submit]")

    # the report page follows the job until the PDF is ready
    expect(page.locator("#state")).to_have_text("ready", timeout=60_000)
    expect(page.locator("#download")).to_be_visible()
    expect(page.locator("#bar")).to_have_attribute("style", "width: 100%;")
    shot(page, "02-report-ready")
    report = Report.objects.get(owner__username="reader")
    assert report.status == ReportStatus.READY

    with page.expect_download() as download_info:
        page.click("#download-link")
    download = download_info.value
    assert download.suggested_filename == report.download_filename()
    path = tmp_path / download.suggested_filename
    download.save_as(path)
    reader, text = pdf_text(path.read_bytes())
    assert len(reader.pages) == report.pages and "Sales summary" in text

    # and the list shows it with its PDF
    page.goto("/reports/")
    expect(page.locator(f'a[href="/api/reports/{report.pk}/download"]')).to_be_visible()
    shot(page, "03-reports-listed")
