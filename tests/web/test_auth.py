"""Bearer tokens (web.auth.TokenAuth) through the real API: what a token's owner and an
operator see of it (Django's test client, PostgreSQL, Redis)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from web.auth import LAST_USED_RESOLUTION
from web.models import ApiToken

pytestmark = pytest.mark.django_db


@pytest.fixture
def token(django_user_model: Any) -> tuple[ApiToken, dict[str, str]]:
    user = django_user_model.objects.create_user("token-user", password="x")
    row, key = ApiToken.issue(user=user, name="auth tests")
    return row, {"HTTP_AUTHORIZATION": f"Bearer {key}"}


def jobs_page(client: Any, bearer: dict[str, str]) -> Any:
    return client.get("/api/jobs/", **bearer)


def token_updates(queries: CaptureQueriesContext) -> int:
    return sum(
        1
        for query in queries.captured_queries
        if query["sql"].startswith("UPDATE") and ApiToken._meta.db_table in query["sql"]
    )


def test_last_used_is_written_once_a_minute_not_once_a_request(client, token, clean_redis):
    row, bearer = token
    assert row.last_used_at is None

    # when: three requests in a row
    with CaptureQueriesContext(connection) as queries:
        for _ in range(3):
            assert jobs_page(client, bearer).status_code == 200

    # then: the token shows it was used, written by the first request only
    row.refresh_from_db()
    assert row.last_used_at is not None
    assert token_updates(queries) == 1

    # when: its last use is older than the resolution
    stale = row.last_used_at - LAST_USED_RESOLUTION - timedelta(seconds=1)
    ApiToken.objects.filter(pk=row.pk).update(last_used_at=stale)
    with CaptureQueriesContext(connection) as queries:
        assert jobs_page(client, bearer).status_code == 200

    # then: the next request brings it up to date
    row.refresh_from_db()
    assert row.last_used_at > stale and token_updates(queries) == 1


def test_a_deactivated_user_is_refused_on_the_next_request(client, token, clean_redis):
    row, bearer = token
    assert jobs_page(client, bearer).status_code == 200

    row.user.is_active = False
    row.user.save(update_fields=["is_active"])

    assert jobs_page(client, bearer).status_code == 401


def test_a_key_finds_its_token_and_user_in_one_select(token, django_assert_num_queries):
    row, bearer = token
    key = bearer["HTTP_AUTHORIZATION"].removeprefix("Bearer ")

    # when: the API looks a key up (web.auth), then reads what the views read of it
    with django_assert_num_queries(1):
        found = ApiToken.objects.for_key(key)
        assert found is not None
        seen = (found.pk, found.name, found.last_used_at, found.user.username, found.user.is_active)

    # then: the same token and user the ORM loads, with no second query for the user
    assert seen == (row.pk, "auth tests", None, "token-user", True)
    assert found.user == row.user and found.created_at == row.created_at
    assert ApiToken.objects.for_key(key + "x") is None
