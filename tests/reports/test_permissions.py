"""Who may ask for what (reports.access): a permission per report kind, and the email rule.

A refused request is a 403 naming the permission, on the API and on the page, and nothing is
written or enqueued for it; the scheduler sends its reports without asking anyone.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Group, Permission
from django.utils import timezone

from jobs.models import Job
from reports import services
from reports.exceptions import ReportPermissionDenied
from reports.models import Report, ReportKind, ReportOrigin
from reports.schemas import report_input_parse
from reports.tasks import report_email_job, report_render_job
from tests.reports.conftest import grant, post_report

pytestmark = pytest.mark.django_db(transaction=True)

TODAY = timezone.localdate()
PERIOD = {"start": str(TODAY - timedelta(days=6)), "end": str(TODAY)}
KIND_PERMISSION = {
    "sales": "reports.request_sales_report",
    "operations": "reports.request_operations_report",
}
ELSEWHERE = "reports.email_report_elsewhere"


@pytest.fixture
def plain(django_user_model: Any) -> Any:
    """A signed-in user with no reports permission (what every user was before)."""
    return django_user_model.objects.create_user(
        "report-plain", email="Plain.User@example.com", password="pw-plain-123"
    )


@pytest.fixture
def nothing_enqueued() -> Any:
    """Asserts, after the test, that it wrote no report and no job."""
    jobs_before = Job.objects.count()
    yield
    assert Report.objects.count() == 0
    assert Job.objects.count() == jobs_before


def page_form(**fields: str) -> dict[str, str]:
    return {"kind": "sales", "start": PERIOD["start"], "end": PERIOD["end"], **fields}


# --- the API --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sales", "operations"])
def test_a_plain_user_is_refused_each_kind_naming_its_permission(
    client, plain, nothing_enqueued, kind
):
    client.force_login(plain)

    response = post_report(client, kind=kind, params=PERIOD)

    assert response.status_code == 403
    assert response.json() == {
        "detail": f"Requesting the {kind} report needs permission {KIND_PERMISSION[kind]}"
    }


@pytest.mark.parametrize("kind", ["sales", "operations"])
def test_a_kinds_permission_admits_that_kind_and_no_other(client, plain, clean_redis, kind):
    other = "operations" if kind == "sales" else "sales"
    client.force_login(grant(plain, KIND_PERMISSION[kind].split(".")[1]))

    accepted = post_report(client, kind=kind, params=PERIOD)
    refused = post_report(client, kind=other, params=PERIOD)

    assert accepted.status_code == 202, accepted.content
    report = Report.objects.get()
    assert report.kind == kind and report.owner == plain
    assert Job.objects.filter(id=accepted.json()["job_id"], task_name="reports.render").exists()
    assert refused.status_code == 403
    assert KIND_PERMISSION[other] in refused.json()["detail"]
    assert Report.objects.count() == 1


def test_operators_get_the_operations_report_through_a_group(client, plain, clean_redis):
    operators = Group.objects.create(name="Operators")
    operators.permissions.add(Permission.objects.get(codename="request_operations_report"))
    plain.groups.add(operators)
    client.force_login(plain)

    assert post_report(client, kind="operations", params=PERIOD).status_code == 202
    assert post_report(client, kind="sales", params=PERIOD).status_code == 403


def test_staff_may_request_every_kind(client, staff, clean_redis):
    client.force_login(staff)

    for kind in ReportKind:
        response = post_report(client, kind=kind.value, params=PERIOD)
        assert response.status_code == 202, (kind, response.content)
    assert Report.objects.filter(owner=staff).count() == len(ReportKind)


def test_bad_input_is_still_400_before_any_permission_is_asked(client, plain, nothing_enqueued):
    client.force_login(plain)

    response = post_report(client, kind="operations", params={"start": "yesterday"})

    assert response.status_code == 400
    assert response.json()["detail"][0]["loc"] == ["body", "params", "start"]


@pytest.mark.parametrize(
    "email_to",
    [
        ["stranger@example.net"],
        ["plain.user@example.com", "stranger@example.net"],  # one other address is enough
    ],
)
def test_emailing_someone_else_needs_email_report_elsewhere(
    client, plain, nothing_enqueued, email_to
):
    client.force_login(grant(plain, "request_sales_report"))

    response = post_report(client, kind="sales", params=PERIOD, email_to=email_to)

    assert response.status_code == 403
    assert response.json() == {
        "detail": "Emailing a report to an address other than your own needs permission "
        f"{ELSEWHERE}"
    }


def test_staff_too_need_email_report_elsewhere(client, staff, nothing_enqueued):
    client.force_login(staff)

    response = post_report(client, kind="operations", params=PERIOD, email_to="x@example.net")

    assert response.status_code == 403 and ELSEWHERE in response.json()["detail"]


def test_with_email_report_elsewhere_any_address_is_accepted(client, plain, clean_redis):
    client.force_login(grant(plain, "request_sales_report", "email_report_elsewhere"))

    response = post_report(
        client, kind="sales", params=PERIOD, email_to="ops@example.net, cfo@example.org"
    )

    assert response.status_code == 202, response.content
    assert Report.objects.get().email_to == ["ops@example.net", "cfo@example.org"]


@pytest.mark.parametrize(
    "email_to", [None, [], "PLAIN.user@example.com", " plain.user@example.com"]
)
def test_blank_or_own_address_is_always_accepted(client, plain, clean_redis, email_to):
    client.force_login(grant(plain, "request_sales_report"))
    payload: dict[str, Any] = {"kind": "sales", "params": PERIOD}
    if email_to is not None:
        payload["email_to"] = email_to

    response = post_report(client, **payload)

    assert response.status_code == 202, response.content
    expected = [email_to.strip()] if email_to else []
    assert Report.objects.get().email_to == expected


def test_a_user_without_an_address_cannot_have_it_emailed(
    client, django_user_model, nothing_enqueued
):
    user = django_user_model.objects.create_user("no-address", password="pw-none-123")
    client.force_login(grant(user, "request_sales_report"))

    response = post_report(client, kind="sales", params=PERIOD, email_to="someone@example.com")

    assert response.status_code == 403 and ELSEWHERE in response.json()["detail"]


def test_the_openapi_schema_declares_the_403(client):
    responses = client.get("/api/openapi.json").json()["paths"]["/api/reports/"]["post"][
        "responses"
    ]
    assert "403" in responses


# --- the service: every caller of report_request gets the rule -----------------------------


def test_the_service_refuses_before_writing(plain, nothing_enqueued):
    request = report_input_parse({"kind": "operations", "params": PERIOD})

    with pytest.raises(ReportPermissionDenied) as refused:
        services.report_request(
            request=request,
            owner=plain,
            origin=ReportOrigin.API,
            render_job=report_render_job,
            email_job=report_email_job,
        )

    assert refused.value.permission == KIND_PERMISSION["operations"]


# --- the page -------------------------------------------------------------------------------


def test_the_page_tells_a_plain_user_they_may_request_nothing(client, plain):
    client.force_login(plain)

    page = client.get("/reports/").content.decode()

    assert 'name="kind"' not in page
    assert 'id="no-kinds"' in page
    assert "reports.request_sales_report" in page and "reports.request_operations_report" in page


def test_the_page_offers_only_the_kinds_the_user_may_request(client, plain):
    client.force_login(grant(plain, "request_sales_report"))

    page = client.get("/reports/")

    form = page.context["form"]
    assert page.status_code == 200
    assert [value for value, _ in form.fields["kind"].widget.choices] == ["sales"]
    content = page.content.decode()
    assert '<option value="sales"' in content and '<option value="operations"' not in content
    # the email rule is explained next to the field
    assert "your own address (plain.user@example.com) only" in content


def test_a_forged_page_request_for_a_kind_not_offered_is_403(client, plain, nothing_enqueued):
    client.force_login(grant(plain, "request_sales_report"))

    response = client.post("/reports/", page_form(kind="operations"))

    assert response.status_code == 403
    assert (
        "Requesting the operations report needs permission reports.request_operations_report"
        in response.content.decode()
    )


def test_page_request_to_someone_else_is_403_naming_the_permission(client, plain, nothing_enqueued):
    client.force_login(grant(plain, "request_sales_report"))

    response = client.post("/reports/", page_form(email_to="stranger@example.net"))

    assert response.status_code == 403
    assert ELSEWHERE in response.context["form"].errors["email_to"][0]


def test_page_request_to_your_own_address_is_accepted(client, plain, clean_redis):
    client.force_login(grant(plain, "request_sales_report"))

    response = client.post("/reports/", page_form(email_to="plain.user@example.com"))

    report = Report.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/reports/{report.pk}/"
    assert report.origin == ReportOrigin.PAGE and report.email_to == ["plain.user@example.com"]


# --- the scheduler --------------------------------------------------------------------------


def test_scheduled_reports_still_go_to_the_configured_recipients(clean_redis):
    # as tests/reports/test_schedule.py runs it: no user, recipients from the configuration
    report_id = services.report_schedule_make(
        kind="operations",
        days=1,
        zone="America/New_York",
        trigger_job_id="0b7c3f1e-2222-4b4b-8c8c-123456789abc",
        recipients=["ops@example.com", "cto@example.net"],
    )

    report = Report.objects.get(pk=report_id)
    assert report.origin == ReportOrigin.SCHEDULE and report.owner is None
    assert report.email_to == ["ops@example.com", "cto@example.net"]
    assert str(report.job_id) == "0b7c3f1e-2222-4b4b-8c8c-123456789abc"  # the scheduled job
