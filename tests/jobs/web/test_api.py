"""The status API's ownership rules, and /health/ and /metrics."""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth import get_user_model

from jobs.models import DeadLetter, Job
from tests.conftest import wait_until
from tests.support import tasks

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def owner():
    return get_user_model().objects.create_user("owner", password="pw-owner-123")


@pytest.fixture
def stranger():
    return get_user_model().objects.create_user("stranger", password="pw-stranger-123")


@pytest.fixture
def owned_job(clean_redis, owner):
    return tasks.prioritized.using(owner=owner).enqueue("k", "a")  # `reports`: stays queued


def test_owner_reads_their_job(client, owner, owned_job):
    client.force_login(owner)
    response = client.get(owned_job.status_url)

    assert response.status_code == 200
    body = response.json()
    assert body["job_id"] == owned_job.id and body["state"] == "queued"
    assert body["attempts"] == 0 and body["max_attempts"] == tasks.prioritized.policy.max_attempts
    assert body["progress"] == {"done": 0, "total": None, "percent": None, "message": ""}
    assert body["enqueued_at"] and body["started_at"] is None and body["queue_wait_seconds"] is None


def test_other_user_gets_404(client, stranger, owned_job):
    client.force_login(stranger)
    assert client.get(owned_job.status_url).status_code == 404


def test_staff_reads_any_job(client, admin_user, owned_job):
    client.force_login(admin_user)
    assert client.get(owned_job.status_url).status_code == 200


def test_anonymous_gets_401(client, owned_job):
    assert client.get(owned_job.status_url).status_code == 401


@pytest.mark.parametrize(
    "job_id", [str(uuid.uuid4()), "not-a-uuid"], ids=["unknown-uuid", "not-a-uuid"]
)
def test_unknown_id_is_404_not_pending(client, admin_user, job_id):
    client.force_login(admin_user)
    response = client.get(f"/api/jobs/{job_id}/")
    assert response.status_code == 404


def test_dead_job_shows_its_error(client, owner, owned_job):
    Job.objects.filter(id=owned_job.id).update(
        state="dead", error="jobs.core.policies.Permanent: nope"
    )
    client.force_login(owner)
    body = client.get(owned_job.status_url).json()
    assert body["state"] == "dead" and body["error"] == "jobs.core.policies.Permanent: nope"


def test_health_reports_checks(client, admin_user, session_worker, clean_redis):
    from jobs.broker.heartbeat import workers_present

    # clean_redis emptied Redis: the worker's presence is back at its next heartbeat (3 s)
    wait_until(lambda: session_worker.name in workers_present(), what="the worker's presence")
    assert set(client.get("/health/").json()) == {"status"}  # details only for operators
    client.force_login(admin_user)
    response = client.get("/health/")

    assert response.status_code == 200
    body = response.json()
    assert body["status"] in {"healthy", "degraded"}
    assert body["checks"]["database"] == "ok"
    assert set(body["checks"]["queues"]) == {"default", "emails", "reports", "media"}
    assert any("default" in queues for queues in body["checks"]["workers"].values())
    # the session worker leaves `reports` to tests' own workers, so health names it
    assert "no worker consumes queue reports" in body["checks"]["problems"]


def test_health_is_503_when_redis_is_unreachable(client, settings, clean_redis):
    from jobs.broker.redis import redis_client

    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    redis_client.cache_clear()
    try:
        response = client.get("/health/")
    finally:
        settings.REDIS_URL = settings.CELERY_BROKER_URL
        redis_client.cache_clear()
    assert response.status_code == 503
    assert response.json()["status"] == "down"


def test_metrics_expose_queue_depth_and_dead_letters(client, clean_redis, settings):
    tasks.prioritized.enqueue("k", "a")  # `reports`: no session worker drains it
    tasks.prioritized.using(priority=9).enqueue("k", "b")
    DeadLetter.objects.create(
        job_id_value=uuid.uuid4(),
        task_name="tests.refused",
        queue="default",
        exception_class="X",
        first_failed_at="2026-01-01T00:00:00Z",
        last_failed_at="2026-01-01T00:00:00Z",
    )

    settings.BACKLOT = {**settings.BACKLOT, "METRICS_TOKEN": "scrape-me"}  # how Prometheus reads
    text = client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-me").content.decode()

    assert 'backlot_queue_depth{queue="reports"} 2.0' in text
    assert 'backlot_dead_letters{status="dead",task="tests.refused"} 1.0' in text


def test_metrics_need_the_token_when_configured(client, settings):
    settings.BACKLOT = {**settings.BACKLOT, "METRICS_TOKEN": "s3cret"}
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret").status_code == 200
