"""No blind spots: depth and oldest wait count due scheduled/retrying rows, the status API calls
them queued, a dead-letter spike degrades health and alerts, /metrics needs its token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core import mail
from django.utils import timezone

from jobs.broker.pausing import pause, resume
from jobs.models import DeadLetter, Job, JobState
from jobs.web.alerts import alerts_check
from jobs.web.checks import check_metrics_token
from jobs.web.monitoring import health_report, queue_stats
from tests.conftest import wait_until
from tests.support import tasks

pytestmark = pytest.mark.django_db(transaction=True)


def ledger_row(
    queue: str, state: str, *, ago: float = 0, due_in: float | None = None, **fields: Any
) -> Job:
    """A job row as the ledger holds it: enqueued `ago` seconds back, due in `due_in` seconds
    (negative: became due that long ago)."""
    now = timezone.now()
    values: dict[str, Any] = {
        "task_name": "tests.add",
        "queue": queue,
        "state": state,
        "enqueued_at": now - timedelta(seconds=ago),
        "scheduled_for": None if due_in is None else now + timedelta(seconds=due_in),
    }
    return Job.objects.create(**{**values, **fields})


def by_queue() -> dict[str, Any]:
    return {q.name: q for q in queue_stats()}


def test_depth_and_oldest_wait_count_due_rows_whatever_their_state(clean_redis):
    published: dict[str, Any] = {"published_at": timezone.now() - timedelta(hours=1)}
    # given `reports`: one of each kind of waiting, plus rows that are not waiting
    ledger_row("reports", JobState.QUEUED, ago=100)
    ledger_row("reports", JobState.SCHEDULED, ago=900, due_in=600, **published)  # not due
    ledger_row("reports", JobState.SCHEDULED, ago=900, due_in=-200, **published)  # a countdown
    ledger_row("reports", JobState.SCHEDULED, ago=3600, due_in=-50)  # waits for the relay
    ledger_row("reports", JobState.RETRYING, ago=5000, due_in=-400, attempts=1, **published)
    ledger_row("reports", JobState.RUNNING, ago=7000, **published)
    ledger_row("reports", JobState.SUCCEEDED, ago=8000, finished_at=timezone.now())
    # `emails`: nothing queued, only a retry backlog enqueued long ago and due 30 s ago
    for _ in range(3):
        ledger_row("emails", JobState.RETRYING, ago=7200, due_in=-30, attempts=2, **published)
    # `media`: only jobs that are not due yet
    ledger_row("media", JobState.SCHEDULED, ago=7200, due_in=60, **published)
    ledger_row("media", JobState.RETRYING, ago=7200, due_in=5, attempts=1, **published)

    stats = by_queue()

    reports, emails, media = stats["reports"], stats["emails"], stats["media"]
    assert (reports.waiting, reports.waiting_due, reports.scheduled, reports.running) == (
        4,
        3,
        1,
        1,
    )
    # the oldest wait is since becoming due (the retry, 400 s), not since enqueue (5000 s)
    assert reports.oldest_wait_seconds == pytest.approx(400, abs=5)
    assert (emails.waiting, emails.waiting_due, emails.scheduled) == (3, 3, 0)
    assert emails.oldest_wait_seconds == pytest.approx(30, abs=5)
    assert (media.waiting, media.waiting_due, media.scheduled) == (0, 0, 2)
    assert media.oldest_wait_seconds == 0.0
    assert stats["default"].waiting == 0 and stats["default"].oldest_wait_seconds == 0.0


def test_a_message_in_redis_and_its_row_count_once(clean_redis, unique):
    # given two published jobs on `reports` (no worker consumes it): each is a message in
    # Redis and a queued row, plus a due retry whose message a worker would hold
    tasks.prioritized.enqueue(unique, "a")
    tasks.prioritized.enqueue(unique, "b")
    ledger_row("reports", JobState.RETRYING, ago=60, due_in=-10, attempts=1)

    reports = by_queue()["reports"]

    assert reports.in_broker == 2
    assert (reports.waiting, reports.waiting_due) == (3, 1)


def test_a_due_retry_backlog_degrades_health_and_shows_in_metrics(client, clean_redis, settings):
    settings.BACKLOT = {
        **settings.BACKLOT,
        "HEALTH_MAX_QUEUE_DEPTH": 2,
        "HEALTH_MAX_WAIT_SECONDS": 60,
        "METRICS_TOKEN": "scrape-me",
    }
    for _ in range(3):
        ledger_row("emails", JobState.RETRYING, ago=3600, due_in=-120, attempts=1)

    status, details = health_report()
    text = client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-me").content.decode()

    problems = details["checks"]["problems"]
    assert status == "degraded"
    assert "queue emails: 3 waiting > 2" in problems
    assert any(p.startswith("queue emails: oldest job waited 12") for p in problems), problems
    assert 'backlot_queue_depth{queue="emails"} 3.0' in text
    oldest = next(
        line
        for line in text.splitlines()
        if line.startswith("backlot_queue_oldest_wait_seconds") and 'queue="emails"' in line
    )
    assert float(oldest.rsplit(" ", 1)[1]) >= 120


def test_a_paused_queue_with_a_due_backlog_is_paused_not_degraded(clean_redis, settings):
    settings.BACKLOT = {**settings.BACKLOT, "HEALTH_MAX_QUEUE_DEPTH": 2}
    for _ in range(3):
        ledger_row("emails", JobState.RETRYING, ago=3600, due_in=-120, attempts=1)
    pause("emails")
    try:
        _, details = health_report()
    finally:
        resume("emails")

    assert details["checks"]["paused"] == ["emails"]
    assert details["checks"]["queues"]["emails"]["waiting"] == 3
    assert [p for p in details["checks"]["problems"] if "emails" in p] == []


def test_the_status_api_says_queued_for_a_due_published_retry(client, clean_redis, unique):
    owner = get_user_model().objects.create_user(f"owner-{unique}")
    published: dict[str, Any] = {
        "published_at": timezone.now() - timedelta(seconds=30),
        "owner": owner,
    }
    due = ledger_row("emails", JobState.RETRYING, ago=60, due_in=-5, attempts=1, **published)
    later = ledger_row("emails", JobState.RETRYING, ago=60, due_in=300, attempts=1, **published)
    client.force_login(owner)

    due_doc = client.get(f"/api/jobs/{due.id}/").json()
    later_doc = client.get(f"/api/jobs/{later.id}/").json()
    listed = {item["job_id"]: item["state"] for item in client.get("/api/jobs/").json()["items"]}

    assert (due_doc["state"], due_doc["attempts"]) == ("queued", 1)
    assert later_doc["state"] == "retrying"
    assert listed == {str(due.id): "queued", str(later.id): "retrying"}  # "My jobs" polls this
    assert Job.objects.get(id=due.id).state == JobState.RETRYING  # the ledger keeps its name


def test_a_dead_letter_spike_degrades_health_and_alerts(worker, settings, unique):
    settings.ADMINS = [("Ops", "ops@example.com")]
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"  # Django's outbox
    settings.BACKLOT = {**settings.BACKLOT, "HEALTH_MAX_DEAD_PER_HOUR": 2}
    # given a provider that starts refusing: three jobs give up on a real worker
    handles = [tasks.refused.enqueue(f"{unique}-{n}", to="x@example.com") for n in range(3)]
    wait_until(
        lambda: Job.objects.filter(id__in=[h.id for h in handles], state="dead").count() == 3,
        what="three refused jobs to give up",
    )

    status, details = health_report()
    fired = alerts_check()["fired"]

    assert status == "degraded"
    assert details["checks"]["dead_letters"]["last_hour"] == 3
    assert "dead letters: 3 in the last hour > 2" in details["checks"]["problems"]
    assert "dead letters: 3 in the last hour > 2" in fired
    (alert,) = [m for m in mail.outbox if "dead letters" in m.subject]
    assert alert.subject.endswith("jobs degraded: dead letters: 3 in the last hour > 2")
    assert alert.to == ["ops@example.com"]


def dead_letter(hours_ago: float) -> DeadLetter:
    at = timezone.now() - timedelta(hours=hours_ago)
    return DeadLetter.objects.create(
        job_id_value=uuid.uuid4(),
        task_name="tests.refused",
        queue="default",
        exception_class="jobs.core.policies.Permanent",
        first_failed_at=at,
        last_failed_at=at,
    )


def test_dead_letters_older_than_an_hour_or_within_the_threshold_are_no_problem(
    clean_redis, settings
):
    settings.BACKLOT = {**settings.BACKLOT, "HEALTH_MAX_DEAD_PER_HOUR": 2}
    for _ in range(2):
        dead_letter(hours_ago=0.1)
    for _ in range(5):
        dead_letter(hours_ago=2)

    _, details = health_report()

    assert details["checks"]["dead_letters"] == {"unresolved": 7, "last_hour": 2}
    assert not [p for p in details["checks"]["problems"] if p.startswith("dead letters")]


@pytest.fixture
def staff(unique):
    return get_user_model().objects.create_user(f"ops-{unique}", is_staff=True)


def test_metrics_refuse_anonymous_scrapes_without_a_token_when_debug_is_off(
    client, clean_redis, settings, staff
):
    settings.DEBUG = False
    settings.BACKLOT = {**settings.BACKLOT, "METRICS_TOKEN": ""}

    anonymous = client.get("/metrics")
    client.force_login(staff)

    assert anonymous.status_code == 401
    assert anonymous["WWW-Authenticate"].startswith("Bearer")
    assert b"METRICS_TOKEN" in anonymous.content
    assert client.get("/metrics").status_code == 200


def test_metrics_answer_the_token_and_staff(client, clean_redis, settings, staff):
    settings.DEBUG = True  # a configured token is asked for even with DEBUG on
    settings.BACKLOT = {**settings.BACKLOT, "METRICS_TOKEN": "s3cret"}

    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="s3cret").status_code == 401  # no scheme
    ok = client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret")
    assert ok.status_code == 200 and b"backlot_queue_depth" in ok.content
    client.force_login(staff)
    assert client.get("/metrics").status_code == 200


def test_metrics_are_open_with_debug_on_and_no_token(client, clean_redis, settings):
    settings.DEBUG = True  # `make run`
    settings.BACKLOT = {**settings.BACKLOT, "METRICS_TOKEN": ""}
    response = client.get("/metrics")
    assert response.status_code == 200 and b"backlot_queue_depth" in response.content


def test_the_system_check_warns_about_an_open_metrics_setup(settings):
    settings.DEBUG = False
    settings.BACKLOT = {**settings.BACKLOT, "METRICS_TOKEN": ""}
    (warning,) = check_metrics_token()
    assert warning.id == "jobs.W005" and "METRICS_TOKEN" in warning.hint

    settings.BACKLOT = {**settings.BACKLOT, "METRICS_TOKEN": "s3cret"}
    assert check_metrics_token() == []
    settings.DEBUG = True
    settings.BACKLOT = {**settings.BACKLOT, "METRICS_TOKEN": ""}
    assert check_metrics_token() == []


def test_admins_come_from_the_environment():
    # the reference project's settings, imported afresh with ADMINS set as .env.example says
    env = {**os.environ, "ADMINS": "Ops Team <ops@example.com>, oncall@example.com"}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    code = (
        "import json, os; os.environ['DJANGO_SETTINGS_MODULE'] = 'config.settings';"
        "from django.conf import settings; print(json.dumps(settings.ADMINS))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out) == [
        ["Ops Team", "ops@example.com"],
        ["oncall@example.com", "oncall@example.com"],
    ]
