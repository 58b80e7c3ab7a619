"""Report history and the demo shop in Django admin."""

from __future__ import annotations

import pytest

from reports.demo import demo_seed
from reports.models import Order, Report, ReportKind, ReportStatus

pytestmark = pytest.mark.django_db


def test_report_history_is_read_only_and_links_the_download(admin_client, admin_user):
    report = Report.objects.create(
        kind=ReportKind.OPERATIONS,
        owner=admin_user,
        params={"start": "2025-03-01", "end": "2025-03-07"},
        email_to=["jane.doe@example.com"],
        status=ReportStatus.FAILED,
        error="Traceback: boom",
    )

    listing = admin_client.get("/admin/reports/report/?status__exact=failed&kind__exact=operations")
    detail = admin_client.get(f"/admin/reports/report/{report.pk}/change/")

    assert listing.status_code == 200 and b"2025-03-01 to 2025-03-07" in listing.content
    assert detail.status_code == 200
    content = detail.content.decode()
    assert "<pre>Traceback: boom</pre>" in content
    assert "j***@example.com" in content and "jane.doe@example.com" not in content
    assert 'name="_save"' not in content  # history: nothing to save
    assert admin_client.get("/admin/reports/report/add/").status_code == 403


def test_ready_report_links_the_permission_checked_download(admin_client, admin_user):
    report = Report.objects.create(
        kind=ReportKind.SALES,
        owner=admin_user,
        params={"start": "2025-03-01", "end": "2025-03-01"},
        status=ReportStatus.RENDERING,
    )
    report.mark_ready(
        file_name="reports/2025/03/x.pdf", pages=2, size_bytes=1000, render_seconds=0.5
    )

    content = admin_client.get(f"/admin/reports/report/{report.pk}/change/").content.decode()

    assert f'href="/api/reports/{report.pk}/download"' in content
    assert "/media/reports/" not in content


def test_demo_shop_admin_pages_render(admin_client):
    demo_seed(days=10)
    order = Order.objects.first()
    assert order is not None

    assert admin_client.get("/admin/reports/product/?category=Audio").status_code == 200
    orders = admin_client.get("/admin/reports/order/")
    assert orders.status_code == 200 and order.number.encode() in orders.content
    assert admin_client.get(f"/admin/reports/order/{order.pk}/change/").status_code == 200
