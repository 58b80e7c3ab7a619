"""Sign-in throttling (jobs.web.throttle, SignInThrottleMiddleware, web.auth.TokenAuth): brute
force on the login page, the admin's login and bearer tokens meets 429 with Retry-After, the
right password works again once the lockout passes or an operator lifts it, and /metrics counts
it. Real Redis (the platform's limiter), real PostgreSQL, Django's test client."""

from __future__ import annotations

from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command

from jobs.web import throttle
from tests.conftest import wait_until

pytestmark = pytest.mark.django_db

PASSWORD = "correct horse battery staple"


@pytest.fixture
def account(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user(
        "brute-target", password=PASSWORD, is_staff=True, is_superuser=True
    )


@pytest.fixture
def limits(settings: Any, clean_redis: None) -> None:
    """3 failures per account, 6 per address, 4 tokens per address, each per hour (a test of the
    window sets a short one: a token back every 5 s)."""
    settings.BACKLOT = {
        **settings.BACKLOT,
        "SIGNIN_FAILURES_PER_ACCOUNT": "3/1h",
        "SIGNIN_FAILURES_PER_ADDRESS": "6/1h",
        "TOKEN_FAILURES_PER_ADDRESS": "4/1h",
        "METRICS_TOKEN": "scrape-me",
    }


@pytest.fixture
def short_window(limits: None, settings: Any) -> None:
    """A failure's token comes back after 5 s (3/15s, 4/20s): long enough that the attempts
    of a loaded machine fit inside it, short enough to wait for."""
    settings.BACKLOT = {
        **settings.BACKLOT,
        "SIGNIN_FAILURES_PER_ACCOUNT": "3/15s",
        "TOKEN_FAILURES_PER_ADDRESS": "4/20s",
    }


def sign_in(client: Any, path: str, password: str, username: str = "brute-target") -> Any:
    return client.post(path, {"username": username, "password": password})


def metrics(client: Any) -> str:
    return client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-me").content.decode()


@pytest.mark.parametrize("path", ["/accounts/login/", "/admin/login/"])
def test_brute_force_gets_429_then_the_right_password_signs_in_after_the_window(
    client, account, short_window, path
):
    # given three wrong passwords (the account's limit)
    for _ in range(3):
        assert sign_in(client, path, "wrong").status_code == 200  # the form again
    # when the right one comes next, then it is refused unchecked, with Retry-After
    refused = sign_in(client, path, PASSWORD)
    assert refused.status_code == 429
    assert int(refused["Retry-After"]) >= 1
    assert "this account" in refused.content.decode()
    assert "_auth_user_id" not in client.session
    # and once a failure's token is back (5 s for 3/15s), the right password signs in
    signed_in = wait_until(
        lambda: (r := sign_in(client, path, PASSWORD)).status_code == 302 and r,
        timeout=20,
        interval=0.5,
        what="the lockout to pass",
    )
    assert signed_in["Location"]
    assert client.session["_auth_user_id"] == str(account.pk)
    text = metrics(client)
    assert 'backlot_signin_failures_total{surface="signin"} 3.0' in text
    assert 'backlot_signin_refused_total{by="account",surface="signin"}' in text


def test_the_login_page_and_the_admin_share_an_accounts_lockout(client, account, limits):
    for path in ("/accounts/login/", "/admin/login/", "/accounts/login/"):
        sign_in(client, path, "wrong")
    assert sign_in(client, "/admin/login/", PASSWORD).status_code == 429


def test_an_address_is_locked_out_across_accounts(client, django_user_model, limits):
    # given six failures from one address, each for a different account
    for n in range(6):
        assert (
            sign_in(client, "/accounts/login/", "wrong", username=f"guess-{n}").status_code == 200
        )
    # then a seventh account from the same address is refused, by address
    django_user_model.objects.create_user("innocent", password=PASSWORD)
    refused = sign_in(client, "/accounts/login/", PASSWORD, username="innocent")
    assert refused.status_code == 429
    assert "this address" in refused.content.decode()
    # and from another address the same account signs in
    other = client.post(
        "/accounts/login/",
        {"username": "innocent", "password": PASSWORD},
        REMOTE_ADDR="10.0.0.7",
    )
    assert other.status_code == 302


def test_an_operator_lifts_a_lockout(client, account, limits):
    for _ in range(3):
        sign_in(client, "/accounts/login/", "wrong")
    assert sign_in(client, "/accounts/login/", PASSWORD).status_code == 429
    out = StringIO()
    call_command("jobs_signin_unlock", account="brute-target", stdout=out)
    assert "1 lockout bucket(s) lifted." in out.getvalue()
    assert "brute-target" not in out.getvalue()
    assert sign_in(client, "/accounts/login/", PASSWORD).status_code == 302


def test_a_successful_sign_in_forgets_the_accounts_failures(client, account, limits):
    for _ in range(2):
        sign_in(client, "/accounts/login/", "wrong")
    assert sign_in(client, "/accounts/login/", PASSWORD).status_code == 302
    client.logout()
    for _ in range(2):
        assert sign_in(client, "/accounts/login/", "wrong").status_code == 200
    assert sign_in(client, "/accounts/login/", PASSWORD).status_code == 302


def test_guessed_bearer_tokens_get_429_with_retry_after_then_a_real_token_works(
    client, account, short_window
):
    from web.models import ApiToken

    _, key = ApiToken.issue(user=account, name="throttle test")
    for n in range(4):
        guessed = client.get("/api/jobs/", HTTP_AUTHORIZATION=f"Bearer guess-{n}")
        assert guessed.status_code == 401
        assert guessed.json()["detail"] == "The bearer token is not valid."
    refused = client.get("/api/jobs/", HTTP_AUTHORIZATION=f"Bearer {key}")
    assert refused.status_code == 429
    assert int(refused["Retry-After"]) >= 1
    wait_until(
        lambda: client.get("/api/jobs/", HTTP_AUTHORIZATION=f"Bearer {key}").status_code == 200,
        timeout=20,
        interval=0.5,
        what="the token lockout to pass",
    )
    text = metrics(client)
    assert 'backlot_signin_failures_total{surface="token"} 4.0' in text
    assert 'backlot_signin_refused_total{by="address",surface="token"}' in text


@pytest.mark.parametrize("locked", [False, True], ids=["free", "locked-out"])
def test_a_token_is_judged_right_after_redis_forgot_the_throttles_script(
    client, account, short_window, locked
):
    # given: an address locked out by guessed tokens, or not; then Redis loses its scripts
    # (restarted or flushed: the lockout's question is answered NOSCRIPT)
    from jobs.broker.redis import redis_client
    from web.models import ApiToken

    _, key = ApiToken.issue(user=account, name="noscript test")
    for n in range(4 if locked else 0):
        client.get("/api/jobs/", HTTP_AUTHORIZATION=f"Bearer guess-{n}")
    redis_client().script_flush()

    # when: the real token is sent
    response = client.get("/api/jobs/", HTTP_AUTHORIZATION=f"Bearer {key}")

    # then: refused while locked out, let through otherwise, as with the script loaded
    assert response.status_code == (429 if locked else 200)


def test_an_anonymous_api_write_is_401_naming_the_missing_credentials(client, clean_redis):
    response = client.post(
        "/api/emails/",
        '{"to": "a@example.com", "template": "test"}',
        content_type="application/json",
    )
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")
    detail = response.json()["detail"]
    assert "Authorization: Bearer <token>" in detail and "sign in" in detail


def test_limits_are_counts_over_periods():
    assert throttle._rate_count("5/15m") == 5
    lockout = throttle.Lockout(by="account", wait=0.2)
    assert lockout.retry_after == 1


def test_with_redis_unreachable_sign_in_and_tokens_still_work(client, account, settings):
    from jobs.broker.redis import redis_client
    from web.models import ApiToken

    _, key = ApiToken.issue(user=account, name="redis away")
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    redis_client.cache_clear()
    try:
        assert sign_in(client, "/accounts/login/", "wrong").status_code == 200
        assert sign_in(client, "/accounts/login/", PASSWORD).status_code == 302
        assert client.get("/api/jobs/", HTTP_AUTHORIZATION=f"Bearer {key}").status_code == 200
    finally:
        settings.REDIS_URL = settings.CELERY_BROKER_URL
        redis_client.cache_clear()
