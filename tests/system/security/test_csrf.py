"""CSRF on the JSON API: session-authenticated writes need the token, bearer-token calls do not."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db.models import Model
from django.test import Client
from django.utils import timezone

from emails.models import EmailMessage
from jobs.models import Job
from reports.models import Report

# Not transactional: enqueue publishes on commit, which never comes, so nothing reaches Redis.
pytestmark = pytest.mark.django_db

TODAY = timezone.localdate()
PERIOD = {"start": str(TODAY - timedelta(days=6)), "end": str(TODAY)}
WRITES = [
    pytest.param(
        "/api/emails/",
        {"to": "csrf.check@example.com", "template": "test"},
        EmailMessage,
        id="emails",
    ),
    pytest.param("/api/reports/", {"kind": "operations", "params": PERIOD}, Report, id="reports"),
]


@pytest.fixture
def browser(api_user: Any) -> Client:
    """A signed-in browser session whose client enforces CSRF like a real browser request."""
    client = Client(enforce_csrf_checks=True)
    client.force_login(api_user)
    return client


def csrf_token(client: Client) -> str:
    """The csrftoken cookie a page hands out (the sign-in form renders {% csrf_token %})."""
    assert client.get("/accounts/login/").status_code == 200
    return client.cookies["csrftoken"].value


def nothing_written(model: type[Model]) -> bool:
    return not Job.objects.exists() and not model._default_manager.exists()


@pytest.mark.parametrize(("url", "body", "model"), WRITES)
@pytest.mark.parametrize("token", [None, "a" * 32], ids=["no-token", "forged-token"])
def test_session_post_without_a_valid_csrf_token_is_403_and_writes_nothing(
    browser, url, body, model, token
):
    csrf_token(browser)  # the cookie alone, as a cross-site form would send it
    headers = {} if token is None else {"HTTP_X_CSRFTOKEN": token}

    response = browser.post(url, body, content_type="application/json", **headers)

    assert response.status_code == 403, response.content
    assert "CSRF" in response.json()["detail"]
    assert nothing_written(model)


@pytest.mark.parametrize(("url", "body", "model"), WRITES)
def test_session_post_with_the_csrf_token_is_accepted(browser, url, body, model):
    token = csrf_token(browser)

    response = browser.post(url, body, content_type="application/json", HTTP_X_CSRFTOKEN=token)

    assert response.status_code == 202, response.content
    assert Job.objects.filter(id=response.json()["job_id"]).exists()
    assert model.objects.count() == 1


@pytest.mark.parametrize(("url", "body", "model"), WRITES)
def test_bearer_token_without_session_or_csrf_token_is_accepted(api_token, url, body, model):
    client = Client(enforce_csrf_checks=True)

    response = client.post(
        url, body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {api_token}"
    )

    assert response.status_code == 202, response.content
    assert Job.objects.filter(id=response.json()["job_id"]).exists()


@pytest.mark.parametrize(("url", "body", "model"), WRITES)
def test_a_junk_bearer_header_does_not_skip_the_csrf_check_of_a_session(browser, url, body, model):
    # An attacker cannot send a valid token, but may add any header a form or fetch allows.
    response = browser.post(
        url, body, content_type="application/json", HTTP_AUTHORIZATION="Bearer not-a-real-token"
    )

    assert response.status_code == 403, response.content
    assert "CSRF" in response.json()["detail"]
    assert nothing_written(model)
