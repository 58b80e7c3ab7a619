"""The API's one parser (web.api_input): bodies over their route's limit, deep nesting, control
characters, through the real API (Django's test client, PostgreSQL, Redis)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth.models import Permission

from emails.models import Campaign, EmailMessage
from reports.models import Report
from web.api_input import MAX_JSON_DEPTH, refused_character
from web.models import ApiToken

pytestmark = pytest.mark.django_db


@pytest.fixture
def bearer(django_user_model: Any) -> dict[str, str]:
    user = django_user_model.objects.create_user("parser-user", password="x")
    user.user_permissions.add(Permission.objects.get(codename="request_operations_report"))
    _, key = ApiToken.issue(user=user, name="parser tests")
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


def post(client: Any, bearer: dict[str, str], path: str, body: str | bytes) -> Any:
    return client.post(path, body, content_type="application/json", **bearer)


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.mark.parametrize("path", ["/api/reports/", "/api/emails/", "/api/campaigns/"])
def test_a_body_nested_50000_deep_is_a_400_naming_the_depth(client, bearer, path, clean_redis):
    body = '{"kind": "operations", "to": "a@example.com", "params": ' + deep(50_000) + "}"
    response = post(client, bearer, path, body)
    assert response.status_code == 400, response.content
    [error] = response.json()["detail"]
    assert error["type"] == "json_depth"
    assert f"at most {MAX_JSON_DEPTH} levels" in error["msg"]


def test_nesting_just_past_the_limit_is_refused_and_at_the_limit_read(client, bearer):
    # given params one level past the limit (the body's object is level 1)
    over = '{"kind": "operations", "params": ' + deep(MAX_JSON_DEPTH) + "}"
    at = '{"kind": "operations", "params": ' + deep(MAX_JSON_DEPTH - 1) + "}"
    assert post(client, bearer, "/api/reports/", over).json()["detail"][0]["type"] == "json_depth"
    # at the limit the body is read and its content judged: params must be an object
    assert post(client, bearer, "/api/reports/", at).json()["detail"][0]["type"] != "json_depth"


def test_an_11_mb_body_is_a_json_413_naming_the_routes_limit(client, bearer, settings):
    response = post(client, bearer, "/api/emails/", b"x" * (11 * 1024 * 1024))
    assert response.status_code == 413
    assert response["Content-Type"] == "application/json"
    [error] = response.json()["detail"]
    assert error["ctx"] == {"limit": settings.API_MAX_BODY_BYTES}
    assert f"at most {settings.API_MAX_BODY_BYTES} bytes" in error["msg"]


def test_a_body_over_the_default_limit_is_413_and_a_campaign_route_has_its_own(
    client, bearer, settings
):
    settings.API_MAX_BODY_BYTES = 1000
    padded = {"to": "a@example.com", "template": "test", "subject": "s" * 1200}
    response = post(client, bearer, "/api/emails/", json.dumps(padded))
    assert response.status_code == 413
    assert response.json()["detail"][0]["ctx"] == {"limit": 1000}
    # the campaign route's own limit (5 MB) takes the same size
    campaign: dict[str, Any] = {
        "name": "Big",
        "recipients": [{"email": "r@example.com"}],
        "context": {"note": "n" * 1200},
    }
    response = post(client, bearer, "/api/campaigns/", json.dumps(campaign))
    assert response.status_code == 201, response.content
    assert not EmailMessage.objects.exists()


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (
            "/api/emails/",
            {"to": "a@example.com", "template": "test", "subject": "Hi\x00there"},
            "subject",
        ),
        ("/api/emails/", {"to": "a@example.com", "template": "test\x1b[2J"}, "template"),
        (
            "/api/emails/",
            {"to": "a@example.com", "template": "test", "context": {"who": "x\x7f"}},
            "context.who",
        ),
        ("/api/campaigns/", {"name": "Spring\x00"}, "name"),
        (
            "/api/campaigns/",
            {"name": "Spring", "recipients": [{"email": "r@example.com", "name": "R\x08"}]},
            "recipients.0.name",
        ),
        (
            "/api/reports/",
            {"kind": "operations", "params": {"start": "2025-01-01\x00", "end": "2025-01-02"}},
            "params.start",
        ),
        (
            "/api/emails/",
            {"to": "a@example.com", "template": "test", "subject": "\ud800"},
            "subject",
        ),
    ],
)
def test_control_characters_in_free_text_are_a_400_naming_the_field(
    client, bearer, path, body, field, clean_redis
):
    response = post(client, bearer, path, json.dumps(body))
    assert response.status_code == 400, response.content
    [error] = response.json()["detail"]
    assert error["type"] == "control_character"
    assert error["loc"] == ["body", *[int(p) if p.isdigit() else p for p in field.split(".")]]
    assert error["msg"].startswith(f"{field} contains a control character")
    # nothing was written for it
    assert not EmailMessage.objects.exists()
    assert not Campaign.objects.exists()
    assert not Report.objects.exists()


def test_tabs_and_line_breaks_stay_allowed_and_a_query_string_is_checked_too(client, bearer):
    assert refused_character("two\tcolumns\r\nand lines") is None
    response = client.get("/api/jobs/", {"task": "emails.send\x00"}, **bearer)
    assert response.status_code == 400
    assert response.json()["detail"][0]["loc"] == ["query", "task"]


@pytest.mark.parametrize("body", ['{"to": NaN}', "{", '{"to": "\\ud83d"', b"\xff\xfe{}"])
def test_what_is_not_json_is_a_400_with_a_reason(client, bearer, body):
    response = post(client, bearer, "/api/reports/", body)
    assert response.status_code == 400
    assert response.json()["detail"][0]["type"] == "json_invalid"
