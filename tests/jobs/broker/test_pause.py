"""Pause and resume a queue on real workers: enqueue still accepts, workers stop taking the
queue within 2 s (those started later too, and those that missed the broadcast), health and
alerts stay quiet about it, and after pausing a backlog twice every job has run exactly once.

The queue is `reports`, which only tests' own workers consume; each test stops its workers."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from django.contrib.auth.models import Permission
from django.core.management import CommandError, call_command
from django.test import Client

from config.celery import app as celery_app
from jobs import enqueue_many
from jobs.broker.pausing import PAUSED_KEY, pause, paused_queues, resume
from jobs.broker.redis import redis_client
from jobs.models import AuditEntry, Job, JobState
from jobs.web.alerts import alerts_check
from jobs.web.monitoring import health_report
from tests.conftest import Worker, marks, wait_until
from tests.support import tasks

BACKLOG = 2000
STOP_BOUND = 2.0  # "workers stop taking that queue's messages within 2 s"
QUIET = 1.0  # how long the count must then stand still to count as stopped
# jobs.worker.celery turns soft shutdown on even when idle: a stopped worker would sleep its 30 s
# (and Worker.stop kills it after 20); these workers have nothing to finish by then.
QUICK_STOP = {"CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT": "1"}


@pytest.fixture
def unpaused() -> Iterator[None]:
    """No queue paused before or after the test (clean_redis empties the set anyway)."""
    redis_client().delete(PAUSED_KEY)
    yield
    redis_client().delete(PAUSED_KEY)


def consumed_by(worker: Worker) -> list[str]:
    answer = celery_app.control.inspect(destination=[worker.name], timeout=1.0).active_queues()
    return sorted(q["name"] for q in (answer or {}).get(worker.name, []))


def stops_growing(count: Callable[[], int], paused_at: float) -> float:
    """Poll `count` until it has stood still for QUIET s; return the seconds from `paused_at`
    (a time.time()) to the last change seen, 0 if none. Fails if it keeps growing."""
    last, since, grew_at = count(), time.time(), None
    deadline = paused_at + STOP_BOUND + QUIET + 2.0
    while time.time() - since < QUIET:
        assert time.time() < deadline, f"still growing {deadline - paused_at:.1f}s after pause"
        time.sleep(0.05)
        value = count()
        if value != last:
            last, since = value, time.time()
            grew_at = since
    return 0.0 if grew_at is None else grew_at - paused_at


def test_pause_with_a_backlog_resume_every_job_once(
    start_worker, clean_redis, unpaused, transactional_db, unique
):
    # given a backlog of 2,000 quick jobs and a worker taking them
    first = start_worker("pause-a", queues="reports", concurrency=2, **QUICK_STOP)
    workers = [first]
    try:
        ids = enqueue_many(tasks.prioritized, [((unique, str(i)), {}) for i in range(BACKLOG)])

        def done() -> int:
            return int(redis_client().llen(f"test:{unique}"))

        wait_until(lambda: done() >= 200, timeout=30, what="some of the backlog to run")

        # when the queue is paused, the done count stops growing within 2 s
        paused_at = time.time()
        assert pause("reports", by="test") is True
        assert stops_growing(done, paused_at) <= STOP_BOUND
        stopped_at = done()
        assert stopped_at < BACKLOG
        # enqueue still accepts while paused
        late = enqueue_many(tasks.prioritized, [((unique, "late"), {})])
        assert Job.objects.get(id=late[0]).state == JobState.QUEUED

        # a worker started while paused does not consume it either
        second = start_worker("pause-b", queues="reports,media", concurrency=1, **QUICK_STOP)
        workers.append(second)
        assert consumed_by(second) == ["media"] and consumed_by(first) == []
        assert stops_growing(done, time.time()) == 0.0 and done() == stopped_at

        # when it is resumed, both consume it again, and nothing else
        assert resume("reports", by="test") is True
        wait_until(lambda: done() > stopped_at + 50, timeout=20, what="the backlog to move again")
        assert consumed_by(first) == ["reports"]
        assert consumed_by(second) == ["media", "reports"]

        # paused and resumed a second time
        paused_at = time.time()
        pause("reports")
        assert stops_growing(done, paused_at) <= STOP_BOUND
        assert done() < BACKLOG + 1, "the second pause came too late to mean anything"
        resume("reports")
        wait_until(lambda: done() == BACKLOG + 1, timeout=60, interval=0.2, what="the backlog")
    finally:
        for worker in workers:
            worker.stop()

    # then every job ran exactly once
    labels = [value for _, value in marks(unique)]
    assert len(labels) == BACKLOG + 1 and len(set(labels)) == BACKLOG + 1
    rows = Job.objects.filter(id__in=ids + late)
    assert rows.filter(state=JobState.SUCCEEDED).count() == BACKLOG + 1
    assert not rows.exclude(attempts=1).exists()


def test_a_worker_that_missed_the_broadcast_converges(start_worker, clean_redis, unpaused, db):
    worker = start_worker("pause-missed", queues="reports", concurrency=1, **QUICK_STOP)
    try:
        # given the flag written without telling anyone (the worker was partitioned)
        written = time.monotonic()
        redis_client().sadd(PAUSED_KEY, "reports")
        wait_until(lambda: consumed_by(worker) == [], timeout=STOP_BOUND, what="the worker's tick")
        assert time.monotonic() - written <= STOP_BOUND + 1.0  # + the inspect round's second
        redis_client().srem(PAUSED_KEY, "reports")
        wait_until(lambda: consumed_by(worker) == ["reports"], timeout=STOP_BOUND, what="resume")
    finally:
        worker.stop()


def test_health_shows_paused_not_degraded_and_alerts_stay_quiet(
    clean_redis, unpaused, transactional_db, settings, unique
):
    settings.BACKLOT = {**settings.BACKLOT, "HEALTH_MAX_QUEUE_DEPTH": 5}
    enqueue_many(tasks.prioritized, [((unique, str(i)), {}) for i in range(20)])
    # given a backlog over the threshold on a queue no worker consumes
    _, details = health_report()
    about_reports = [p for p in details["checks"]["problems"] if "reports" in p]
    assert about_reports == ["queue reports: 20 waiting > 5", "no worker consumes queue reports"]

    pause("reports")
    _, details = health_report()
    assert details["checks"]["paused"] == ["reports"]
    assert details["checks"]["queues"]["reports"]["waiting"] == 20
    assert [p for p in details["checks"]["problems"] if "reports" in p] == []
    assert [p for p in alerts_check()["fired"] if "reports" in p] == []

    resume("reports")
    _, details = health_report()
    assert details["checks"]["paused"] == []
    assert "queue reports: 20 waiting > 5" in details["checks"]["problems"]


def test_metrics_gauge(admin_client, clean_redis, unpaused):
    pause("emails")
    text = admin_client.get("/metrics").content.decode()
    assert 'backlot_queue_paused{queue="emails"} 1.0' in text
    assert 'backlot_queue_paused{queue="reports"} 0.0' in text


def test_command_pauses_and_resumes_audited(capsys, clean_redis, unpaused, db):
    call_command("jobs", "pause", "reports")
    assert "Paused queue reports" in capsys.readouterr().out
    assert paused_queues() == {"reports"}
    call_command("jobs", "pause", "reports")
    assert "was paused already" in capsys.readouterr().out
    call_command("jobs", "status")
    assert any(
        line.split()[:2] == ["reports", "paused"] for line in capsys.readouterr().out.splitlines()
    )
    call_command("jobs", "resume", "reports")
    assert "Resumed queue reports" in capsys.readouterr().out
    assert paused_queues() == set()
    with pytest.raises(CommandError, match="configured queues are: default, emails, reports"):
        call_command("jobs", "pause", "nope")
    actions = list(AuditEntry.objects.order_by("pk").values_list("action", "count"))
    assert actions == [("pause-cli", 1), ("pause-cli", 0), ("resume-cli", 1)]


@pytest.fixture
def operator(django_user_model):
    """A staff user who may pause queues (and look at jobs)."""
    user = django_user_model.objects.create_user("operator", password="pw", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(codename__in=["pause_queue", "view_job"]))
    return user


def test_api_is_staff_only_permission_checked_and_audited(
    client, django_user_model, operator, clean_redis, unpaused
):
    plain = django_user_model.objects.create_user("plain", password="pw")
    staff = django_user_model.objects.create_user("staff", password="pw", is_staff=True)

    assert client.get("/api/queues/").status_code == 401
    client.force_login(plain)
    assert client.get("/api/queues/").status_code == 403
    assert client.post("/api/queues/reports/pause").status_code == 403
    client.force_login(staff)  # staff, without the permission: may look, not act
    assert client.get("/api/queues/").status_code == 200
    assert client.post("/api/queues/reports/pause").status_code == 403
    assert paused_queues() == set()

    client.force_login(operator)
    response = client.post("/api/queues/reports/pause")
    assert response.status_code == 200, response.content
    assert response.json()["paused"] is True and response.json()["paused_by"] == "operator"
    listed = {q["name"]: q for q in client.get("/api/queues/").json()["queues"]}
    assert listed["reports"]["paused"] is True and listed["emails"]["paused"] is False
    assert set(listed) == {"default", "emails", "reports", "media"}
    assert client.post("/api/queues/reports/resume").json()["paused"] is False
    missing = client.post("/api/queues/nope/pause")
    assert missing.status_code == 404 and "default, emails, reports" in missing.json()["detail"]
    assert list(AuditEntry.objects.order_by("pk").values_list("action", "user")) == [
        ("pause-api", operator.pk),
        ("resume-api", operator.pk),
    ]


def test_dashboard_button_pauses_and_resumes(
    client, operator, django_user_model, clean_redis, unpaused
):
    url = "/admin/jobs/job/dashboard/"
    client.force_login(operator)
    page = client.get(url).content.decode()
    assert 'name="operation" value="pause"' in page and "Pause</button>" in page

    response = client.post(url, {"operation": "pause", "queue": "reports"}, follow=True)
    assert response.redirect_chain[-1][0] == url
    page = response.content.decode()
    assert "Queue reports paused" in page
    assert '<td class="state paused">paused</td>' in page and "Resume</button>" in page
    assert paused_queues() == {"reports"}
    response = client.post(url, {"operation": "resume", "queue": "reports"}, follow=True)
    assert "Queue reports resumed." in response.content.decode()
    assert paused_queues() == set()
    assert list(AuditEntry.objects.order_by("pk").values_list("action", "user")) == [
        ("pause-admin", operator.pk),
        ("resume-admin", operator.pk),
    ]

    # a viewer without the permission sees no button and a forged POST is refused
    viewer = django_user_model.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_job"))
    client.force_login(viewer)
    assert "Pause</button>" not in client.get(url).content.decode()
    assert client.post(url, {"operation": "pause", "queue": "reports"}).status_code == 403
    # and a POST without the CSRF token is refused before it acts
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(operator)
    assert strict.post(url, {"operation": "pause", "queue": "reports"}).status_code == 403
    assert paused_queues() == set()
