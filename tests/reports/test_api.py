"""The reports API's input rules and access rules (no worker: nothing here needs to run)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from jobs.broker.ratelimit import redis_client
from jobs.models import Job
from reports.models import Report, ReportKind, ReportStatus
from tests.reports.conftest import grant, post_report

pytestmark = pytest.mark.django_db(transaction=True)

TODAY = timezone.localdate()
GOOD = {"start": str(TODAY - timedelta(days=6)), "end": str(TODAY)}


def reports_queue_length() -> int:
    client = redis_client()
    return sum(
        int(client.llen(key))
        for key in client.scan_iter(match="reports*")
        if client.type(key) == b"list"
    )


@pytest.mark.parametrize(
    "payload, loc, message",
    [
        (
            {"kind": "weather", "params": GOOD},
            ["body", "kind"],
            "Input should be 'operations' or 'sales'",
        ),
        ({"params": GOOD}, ["body", "kind"], "Field required"),
        (
            {"kind": ["sales"], "params": GOOD},
            ["body", "kind"],
            "Input should be 'operations' or 'sales'",
        ),
        (
            {"kind": "sales", "params": {**GOOD, "start": "2025-02-30"}},
            ["body", "params", "start"],
            "is not a date",
        ),
        (
            {"kind": "sales", "params": {**GOOD, "end": "yesterday"}},
            ["body", "params", "end"],
            "is not a date",
        ),
        (
            {"kind": "sales", "params": {**GOOD, "start": 20250101}},
            ["body", "params", "start"],
            "YYYY-MM-DD",
        ),
        (
            {"kind": "operations", "params": {"start": "2025-03-10", "end": "2025-03-01"}},
            ["body", "params", "end"],
            "End (2025-03-01) is before start (2025-03-10).",
        ),
        (
            {"kind": "operations", "params": {"start": "2023-01-01", "end": "2024-12-31"}},
            ["body", "params", "end"],
            "The period is 731 days; a report covers at most 366.",
        ),
        (
            {
                "kind": "operations",
                "params": {
                    **GOOD,
                    "start": str(TODAY + timedelta(days=3)),
                    "end": str(TODAY + timedelta(days=4)),
                },
            },
            ["body", "params", "start"],
            "is in the future",
        ),
        (
            {"kind": "operations", "params": {"end": GOOD["end"]}},
            ["body", "params", "start"],
            "Field required",
        ),
        (
            {"kind": "operations", "params": {**GOOD, "timezone": "Mars/Olympus"}},
            ["body", "params", "timezone"],
            "Unknown time zone 'Mars/Olympus'",
        ),
        (
            {"kind": "operations", "params": {**GOOD, "queue": "emails"}},
            ["body", "params", "queue"],
            "Extra inputs",
        ),
        ({"kind": "operations", "params": "last week"}, ["body", "params"], "valid dictionary"),
        (
            {"kind": "sales", "params": GOOD, "email_to": ["ok@example.com", "not-an-address"]},
            ["body", "email_to", 1],
            "Enter a valid email address.",
        ),
        ({"kind": "sales", "params": GOOD, "surprise": 1}, ["body", "surprise"], "Extra inputs"),
    ],
)
def test_bad_input_is_400_with_a_field_message_and_nothing_is_written_or_enqueued(
    client, owner, clean_redis, payload, loc, message
):
    client.force_login(owner)

    response = post_report(client, **payload)

    assert response.status_code == 400, response.content
    errors = response.json()["detail"]
    assert any(error["loc"] == loc and message in error["msg"] for error in errors), errors
    assert Report.objects.count() == 0 and Job.objects.count() == 0
    assert reports_queue_length() == 0


def test_every_bad_field_is_named_in_one_answer(client, owner):
    client.force_login(owner)

    response = post_report(
        client, kind="sales", params={"start": "2025-03-10", "end": "2025-03-01"}, email_to="x"
    )

    assert response.status_code == 400
    assert [error["loc"] for error in response.json()["detail"]] == [
        ["body", "email_to", 0],
        ["body", "params", "end"],
    ]


@pytest.mark.parametrize("body", ["[]", "null", '"sales"', "42"])
def test_body_that_is_not_an_object_is_400(client, owner, body):
    client.force_login(owner)
    response = client.post("/api/reports/", body, content_type="application/json")

    assert response.status_code == 400
    assert Report.objects.count() == 0


def test_body_that_is_not_json_is_400(client, owner):
    client.force_login(owner)
    response = client.post("/api/reports/", "kind=sales", content_type="application/json")

    assert response.status_code == 400
    assert response.json()["detail"][0]["loc"] == ["body"]
    assert Report.objects.count() == 0


def test_anonymous_requests_are_401(client):
    assert post_report(client, kind="sales", params=GOOD).status_code == 401
    assert client.get("/api/reports/1/").status_code == 401
    assert client.get("/api/reports/1/download").status_code == 401


def test_email_to_accepts_a_comma_separated_string(client, owner, clean_redis):
    client.force_login(grant(owner, "email_report_elsewhere"))

    response = post_report(
        client, kind="sales", params=GOOD, email_to="a@example.com, b@example.com"
    )

    assert response.status_code == 202
    report = Report.objects.get(pk=response.json()["report_id"])
    assert report.email_to == ["a@example.com", "b@example.com"]


def test_accepted_request_writes_the_report_and_its_job(client, owner, clean_redis):
    client.force_login(owner)

    response = post_report(
        client, kind="operations", params={**GOOD, "timezone": "America/New_York"}
    )

    assert response.status_code == 202
    body = response.json()
    assert set(body) == {"report_id", "job_id", "status_url", "state"}
    report = Report.objects.get(pk=body["report_id"])
    assert (
        report.owner == owner
        and report.kind == ReportKind.OPERATIONS
        and report.status == ReportStatus.QUEUED
    )
    assert report.params == {**GOOD, "timezone": "America/New_York"}
    job = Job.objects.get(id=body["job_id"])
    assert str(report.job_id) == body["job_id"]
    assert job.task_name == "reports.render" and job.queue == "reports" and job.owner == owner
    assert job.args == [report.pk]
    assert body["status_url"] == f"/api/reports/{report.pk}/"


def test_status_and_download_are_for_owner_and_staff_only(client, owner, stranger, staff):
    report = Report.objects.create(kind=ReportKind.SALES, owner=owner, params=GOOD)

    client.force_login(stranger)
    assert client.get(f"/api/reports/{report.pk}/").status_code == 404
    assert client.get(f"/api/reports/{report.pk}/download").status_code == 404

    client.force_login(owner)
    status = client.get(f"/api/reports/{report.pk}/")
    assert status.status_code == 200
    assert status.json()["state"] == "queued" and status.json()["download_url"] is None
    not_ready = client.get(f"/api/reports/{report.pk}/download")
    assert not_ready.status_code == 409 and "queued" in not_ready.json()["detail"]

    client.force_login(staff)
    assert client.get(f"/api/reports/{report.pk}/").status_code == 200


def test_unknown_report_is_404(client, staff):
    client.force_login(staff)
    assert client.get("/api/reports/999999/").status_code == 404
    assert client.get("/api/reports/not-a-number/").status_code == 404


def test_openapi_documents_the_request_body(client):
    spec = client.get("/api/openapi.json").json()
    body = spec["paths"]["/api/reports/"]["post"]["requestBody"]["content"]["application/json"][
        "schema"
    ]

    assert body["required"] == ["kind"]
    assert body["properties"]["kind"]["enum"] == ["operations", "sales"]
    assert "400" in spec["paths"]["/api/reports/"]["post"]["responses"]
    assert "403" in spec["paths"]["/api/reports/"]["post"]["responses"]
