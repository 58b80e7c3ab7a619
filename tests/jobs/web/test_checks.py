"""System checks: unsafe Celery settings and misdeclared jobs fail `manage.py check`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.core import checks

from config.celery import app as celery_app
from jobs.core.policies import RetryPolicy
from jobs.web.checks import check_celery_settings, check_jobs
from jobs.worker.decorators import job


def ids(problems: list[Any]) -> list[str]:
    return [problem.id for problem in problems]


@pytest.fixture
def declare() -> Iterator[Any]:
    """Declare a job for one test and unregister it afterwards."""
    names: list[str] = []

    def declare_job(name: str, **options: Any) -> Any:
        # a def, not a lambda: Celery builds the task's signature check from the function name
        def noop() -> None:
            pass

        names.append(name)
        return job(name=name, **options)(noop)

    yield declare_job
    for name in names:
        celery_app.tasks.pop(name, None)


# --- check_celery_settings -----------------------------------------------------------------


def test_default_settings_pass():
    assert check_celery_settings() == []


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("CELERY_ACCEPT_CONTENT", ["json", "pickle"]),
        ("CELERY_RESULT_ACCEPT_CONTENT", ["json", "application/x-python-serialize"]),
        ("CELERY_ACCEPT_CONTENT", ["yaml"]),
    ],
)
def test_accepting_anything_but_json_is_an_error(settings, setting, value):
    setattr(settings, setting, value)

    problems = check_celery_settings()

    assert ids(problems) == ["jobs.E001"]
    assert isinstance(problems[0], checks.Error)
    assert "only JSON is allowed" in problems[0].msg
    assert problems[0].hint == "Set CELERY_ACCEPT_CONTENT = ['json']."


def test_json_content_type_aliases_are_allowed(settings):
    settings.CELERY_ACCEPT_CONTENT = ["json", "application/json"]
    assert check_celery_settings() == []


@pytest.mark.parametrize("visibility", [900, 930])
def test_visibility_timeout_not_above_held_countdowns_is_an_error(settings, visibility):
    # defaults: countdowns up to 900 s in Redis, plus up to 30 s reserved by rate limits
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = {
        **settings.CELERY_BROKER_TRANSPORT_OPTIONS,
        "visibility_timeout": visibility,
    }

    problems = check_celery_settings()

    assert ids(problems) == ["jobs.E002"]
    assert isinstance(problems[0], checks.Error)
    assert (
        f"Countdowns up to 930s may sit in Redis but the visibility timeout is {visibility}s"
        in problems[0].msg
    )


def test_visibility_timeout_is_checked_against_the_configured_limits(settings):
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = {
        **settings.CELERY_BROKER_TRANSPORT_OPTIONS,
        "visibility_timeout": 1000,
    }
    assert check_celery_settings() == []

    settings.BACKLOT = {**settings.BACKLOT, "RATE_LIMIT_MAX_RESERVE": 120.0}
    assert ids(check_celery_settings()) == ["jobs.E002"]


def test_both_problems_are_reported_together(settings):
    settings.CELERY_ACCEPT_CONTENT = ["pickle"]
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = {
        **settings.CELERY_BROKER_TRANSPORT_OPTIONS,
        "visibility_timeout": 60,
    }
    assert ids(check_celery_settings()) == ["jobs.E001", "jobs.E002"]


# --- check_jobs ----------------------------------------------------------------------------


def test_registered_jobs_pass():
    assert check_jobs() == []


def test_unknown_queue_is_an_error_naming_the_job(declare):
    declare("tests.checks.badqueue", queue="nope")

    problems = check_jobs()

    assert ids(problems) == ["jobs.E003"]
    error = problems[0]
    assert isinstance(error, checks.Error)
    assert error.obj == "tests.checks.badqueue"
    assert error.msg == "Job tests.checks.badqueue uses queue 'nope', which is not configured."
    assert error.hint == "Use one of default, emails, reports, media."


def test_removed_job_no_longer_fails_the_check(declare):
    declare("tests.checks.badqueue", queue="nope")
    celery_app.tasks.pop("tests.checks.badqueue")

    assert check_jobs() == []


def test_retries_that_retry_nothing_are_a_warning(declare):
    declare("tests.checks.noretry", retry=RetryPolicy(max_attempts=3, retry_on=()))

    problems = check_jobs()

    assert ids(problems) == ["jobs.W001"]
    assert isinstance(problems[0], checks.Warning)
    assert "tests.checks.noretry" in problems[0].msg


def test_checks_run_with_manage_py_check(settings):
    settings.CELERY_ACCEPT_CONTENT = ["json", "pickle"]

    problems = checks.run_checks(tags=[checks.Tags.compatibility])

    assert "jobs.E001" in ids(problems)


@pytest.mark.parametrize(
    "rate_limit",
    ["fast", "10/d", {"free": "5/s", "pro": "lots"}],
)
def test_invalid_rate_limit_is_rejected_when_the_job_is_declared(rate_limit):
    with pytest.raises(ValueError, match="Invalid rate limit"):
        job(name="tests.checks.badrate", rate_limit=rate_limit)

    assert "tests.checks.badrate" not in celery_app.tasks


@pytest.mark.parametrize("priority", [-1, 10])
def test_priority_out_of_range_is_rejected_when_the_job_is_declared(priority):
    with pytest.raises(ValueError, match=f"priority must be 0-9, got {priority}"):
        job(name="tests.checks.badpriority", priority=priority)


def test_check_warns_when_redis_is_not_durable(settings):
    from jobs.broker.redis import redis_client
    from jobs.web.checks import check_redis_durability

    client = redis_client()
    policy = client.config_get("maxmemory-policy")["maxmemory-policy"]
    assert policy is not None
    client.config_set("maxmemory-policy", "allkeys-lru")
    try:
        ids = {w.id for w in check_redis_durability()}
    finally:
        client.config_set("maxmemory-policy", policy)
    assert "jobs.W003" in ids
    assert "jobs.W003" not in {w.id for w in check_redis_durability()}

    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    assert {w.id for w in check_redis_durability()} == {"jobs.W002"}
