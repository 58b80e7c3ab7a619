"""The email pages a signed-in user works with."""

from __future__ import annotations

import pytest

from emails.models import Campaign, EmailMessage

pytestmark = pytest.mark.django_db(transaction=True)


def test_pages_need_a_signed_in_user(client):
    response = client.get("/emails/")
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")


def test_send_test_email_from_the_page_leads_to_its_job_page(client, admin_user, clean_redis):
    client.force_login(admin_user)
    assert b"Send a test email" in client.get("/emails/").content

    response = client.post(
        "/emails/", {"to": "someone@example.com", "template": "test", "name": "S"}
    )

    message = EmailMessage.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/jobs/{message.job_id}/"
    page = client.get(response["Location"])
    assert (
        page.status_code == 200
        and b"emails.send" in page.content
        and b"data-status-url" in page.content
    )


def test_bad_address_shows_the_error_on_the_form(client, admin_user):
    client.force_login(admin_user)
    response = client.post("/emails/", {"to": "nope", "template": "test"})
    assert response.status_code == 200 and b"Enter a valid email address" in response.content
    assert EmailMessage.objects.count() == 0


def test_campaign_page_flow(client, admin_user, clean_redis):
    client.force_login(admin_user)
    response = client.post(
        "/emails/campaigns/", {"name": "Spring", "headline": "Hi", "body": "Text"}
    )
    campaign = Campaign.objects.get()
    assert response["Location"] == f"/emails/campaigns/{campaign.pk}/"

    page = client.get(response["Location"])
    assert b"Import recipients" in page.content and b"Start sending" in page.content


def test_a_regular_user_signs_in_on_the_login_page(client, django_user_model):
    django_user_model.objects.create_user("plain", password="pw-plain-12345")

    page = client.get("/accounts/login/?next=/emails/")
    response = client.post(
        "/accounts/login/", {"username": "plain", "password": "pw-plain-12345", "next": "/emails/"}
    )

    assert page.status_code == 200 and b"Sign in" in page.content
    assert response.status_code == 302 and response["Location"] == "/emails/"
    assert client.get("/emails/").status_code == 200


def test_nul_characters_are_a_400_not_a_server_error(client, admin_user):
    client.force_login(admin_user)

    email = client.post(
        "/api/emails/",
        {"to": "a@example.com", "template": "test", "context": {"name": "x\u0000y"}},
        content_type="application/json",
    )
    campaign = client.post(
        "/api/campaigns/",
        {"name": "n", "context": {"k\u0000": None}},
        content_type="application/json",
    )

    # refused by the API's parser (web.api_input), naming the field
    assert email.status_code == 400 and "NUL" in email.json()["detail"][0]["msg"]
    assert email.json()["detail"][0]["loc"] == ["body", "context", "name"]
    assert campaign.status_code == 400 and "NUL" in campaign.json()["detail"][0]["msg"]
    assert EmailMessage.objects.count() == 0 and Campaign.objects.count() == 0


def test_the_email_page_gives_every_form_field_an_id_of_its_own(client, admin_user):
    import re

    client.force_login(admin_user)
    page = client.get("/emails/").content.decode()
    ids = re.findall(r'\sid="([^"]+)"', page)
    assert "id_name" in ids and "id_campaign_name" in ids
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    # every label points at a field that exists
    for target in re.findall(r'<label for="([^"]+)"', page):
        assert target in ids
