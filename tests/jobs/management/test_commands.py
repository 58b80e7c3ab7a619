"""manage.py jobs status|retry|discard|purge, retention and alerts."""

from __future__ import annotations

import io
import json
import time
import uuid
from datetime import timedelta

import pytest
from django.core import mail
from django.core.management import CommandError, call_command
from django.utils import timezone

from jobs.broker.redis import redis_client
from jobs.models import (
    AuditEntry,
    Batch,
    BatchState,
    DeadLetter,
    DeadLetterStatus,
    Effect,
    Job,
    JobState,
)
from jobs.web.alerts import alerts_check
from tests.support import tasks

pytestmark = pytest.mark.django_db(transaction=True)


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("jobs", *args, stdout=out)
    return out.getvalue()


def dead_letter(**fields) -> DeadLetter:
    now = timezone.now()
    values = {
        "job_id_value": uuid.uuid4(),
        "task_name": "tests.prioritized",
        "args": ["k", "x"],
        "kwargs": {},
        "queue": "reports",
        "exception_class": "ConnectionError",
        "exception_message": "refused",
        "first_failed_at": now,
        "last_failed_at": now,
    }
    return DeadLetter.objects.create(**{**values, **fields})


def test_status_prints_a_table_and_json(clean_redis):
    tasks.prioritized.enqueue("k", "a")

    table = run("status")
    data = json.loads(run("status", "--json"))

    assert "queue" in table and "waiting" in table and "reports" in table
    assert next(q for q in data["queues"] if q["name"] == "reports")["waiting"] == 1


def test_retry_filters_dry_run_and_limit(clean_redis):
    refused = [dead_letter() for _ in range(3)]
    other = dead_letter(exception_class="ValueError")

    preview = run("retry", "--exception", "ConnectionError", "--dry-run")
    assert "Would replay 3 dead letter(s)" in preview
    assert DeadLetter.objects.unresolved().count() == 4

    assert "Replayed 2 dead letter(s)" in run(
        "retry", "--exception", "ConnectionError", "--limit", "2"
    )
    assert (
        DeadLetter.objects.filter(
            pk__in=[r.pk for r in refused], status=DeadLetterStatus.REPLAYED
        ).count()
        == 2
    )
    assert Job.objects.filter(replay_of__isnull=False).count() == 2
    other.refresh_from_db()
    assert other.status == DeadLetterStatus.DEAD
    assert AuditEntry.objects.get(action="replay-cli").count == 2


def test_discard_by_task(clean_redis):
    dead_letter(task_name="tests.a")
    dead_letter(task_name="tests.b")

    assert "Discarded 1 dead letter(s)" in run("discard", "--task", "tests.a")
    assert set(DeadLetter.objects.values_list("task_name", "status")) == {
        ("tests.a", "discarded"),
        ("tests.b", "dead"),
    }


def test_bad_date_is_a_clear_error():
    from django.core.management import CommandError

    with pytest.raises(CommandError, match="--since must be an ISO date-time"):
        run("retry", "--since", "yesterday")


def test_purge_keeps_unresolved_dead_letters_and_recent_rows(clean_redis):
    old = timezone.now() - timedelta(days=40)
    kept_dead = dead_letter(last_failed_at=old, first_failed_at=old)
    gone_discarded = dead_letter(status=DeadLetterStatus.DISCARDED, resolved_at=old)
    h_old = tasks.prioritized.enqueue("k", "old")
    h_new = tasks.prioritized.enqueue("k", "new")
    Job.objects.filter(id=h_old.id).update(
        state=JobState.SUCCEEDED, enqueued_at=old, finished_at=old
    )
    Job.objects.filter(id=h_new.id).update(state=JobState.SUCCEEDED, finished_at=timezone.now())
    Effect.objects.create(key="ancient", created_at=timezone.now() - timedelta(days=400))

    assert "Would delete: 1 dead_letters, 1 jobs, 1 effects" in run("purge", "--dry-run")
    run("purge")

    assert DeadLetter.objects.filter(pk=kept_dead.pk).exists()
    assert not DeadLetter.objects.filter(pk=gone_discarded.pk).exists()
    assert list(Job.objects.values_list("id", flat=True)) == [uuid.UUID(h_new.id)]
    assert not Effect.objects.filter(key="ancient").exists()


def test_purge_deletes_a_batch_with_its_last_member(clean_redis):
    old = timezone.now() - timedelta(days=40)
    done = Batch.objects.create(state=BatchState.SUCCEEDED, completed_at=old, total=1)
    member = tasks.prioritized.enqueue("k", "member")
    Job.objects.filter(id=member.id).update(
        state=JobState.SUCCEEDED, enqueued_at=old, finished_at=old, batch_id=done.id
    )
    held = Batch.objects.create(state=BatchState.COMPLETE, completed_at=old, total=1)
    dead = tasks.prioritized.enqueue("k", "dead")
    Job.objects.filter(id=dead.id).update(
        state=JobState.DEAD, enqueued_at=old, finished_at=old, batch_id=held.id
    )
    dead_letter(job_id=dead.id, last_failed_at=old, first_failed_at=old)  # unresolved: kept
    recent = Batch.objects.create(state=BatchState.SUCCEEDED, completed_at=timezone.now())
    running = Batch.objects.create(state=BatchState.RUNNING)

    # the old member goes in this purge, and with it its batch
    assert "1 jobs" in run("purge", "--dry-run") and "1 batches" in run("purge", "--dry-run")
    assert "1 batches" in run("purge")

    left = set(Batch.objects.values_list("id", flat=True))
    assert left == {held.id, recent.id, running.id}
    assert Job.objects.filter(id=dead.id, batch_id=held.id).exists()
    assert "0 batches" in run("purge")


def test_degraded_health_alerts_once_and_announces_recovery(clean_redis, settings):
    settings.ADMINS = [("Ops", "ops@example.com")]
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"  # Django's outbox
    settings.BACKLOT = {**settings.BACKLOT, "HEALTH_MAX_QUEUE_DEPTH": 1}
    tasks.prioritized.enqueue("k", "a")
    tasks.prioritized.enqueue("k", "b")  # `reports` now has 2 waiting > 1

    first = alerts_check()
    second = alerts_check()

    assert any("queue reports: 2 waiting > 1" in p for p in first["fired"])
    assert not any(
        "reports: " in p and "waiting" in p for p in second["fired"]
    )  # once per interval
    assert any("waiting" in m.subject and "reports" in m.subject for m in mail.outbox)

    # the backlog drains: the jobs ran (the ledger's waiting rows count, not only Redis')
    redis_client().delete(*redis_client().scan_iter("reports*"))
    Job.objects.filter(queue="reports").update(state=JobState.SUCCEEDED, finished_at=timezone.now())
    recovered = alerts_check()["recovered"]
    assert any("reports" in cause for cause in recovered)
    assert any("jobs recovered" in m.subject for m in mail.outbox)


def test_relay_once_publishes_the_outbox(clean_redis):
    from jobs.broker.queues import queue_keys as broker_queue_keys

    handle = tasks.prioritized.enqueue("k", "a")
    Job.objects.filter(id=handle.id).update(
        published_at=None, enqueued_at=timezone.now() - timedelta(minutes=1)
    )
    redis_client().delete(*broker_queue_keys("reports"))  # the message never made it

    out = run("relay", "--once")

    assert "relay: published 1 job(s)" in out
    assert sum(redis_client().llen(k) for k in broker_queue_keys("reports")) == 1


def test_relay_resends_a_retry_whose_message_was_lost(clean_redis):
    from jobs.broker.queues import queue_keys as broker_queue_keys

    # given: a retrying job, due a minute ago, published, but its message is gone from Redis
    handle = tasks.prioritized.enqueue("k", "a")
    a_minute_ago = timezone.now() - timedelta(minutes=1)
    Job.objects.filter(id=handle.id).update(
        state=JobState.RETRYING, attempts=1, scheduled_for=a_minute_ago, published_at=a_minute_ago
    )
    redis_client().delete(*broker_queue_keys("reports"))

    # when: the relay sweeps while nothing is queued or unacknowledged
    out = run("relay", "--once")

    # then: the job's message is back in its queue
    assert "relay: published 1 job(s)" in out
    assert sum(redis_client().llen(k) for k in broker_queue_keys("reports")) == 1


def test_relay_leaves_a_waiting_job_alone_while_its_queue_holds_messages(clean_redis):
    from jobs.broker.queues import queue_keys as broker_queue_keys

    first = tasks.prioritized.enqueue("k", "a")
    tasks.prioritized.enqueue("k", "b")
    a_minute_ago = timezone.now() - timedelta(minutes=1)
    Job.objects.filter(id=first.id).update(published_at=a_minute_ago)

    out = run("relay", "--once")

    assert "published" not in out  # the queue is not empty: the message may be in it
    assert sum(redis_client().llen(k) for k in broker_queue_keys("reports")) == 2


def test_relay_alive_answers_from_the_last_sweep(clean_redis):
    from jobs.management.commands.jobs import RELAY_HEARTBEAT

    with pytest.raises(CommandError, match="last sweep never"):
        run("relay", "--alive")

    run("relay", "--once")

    assert "relay: alive" in run("relay", "--alive")
    redis_client().set(RELAY_HEARTBEAT, repr(time.time() - 120))
    with pytest.raises(CommandError, match=r"last sweep 12[0-9]s ago"):
        run("relay", "--alive", "30")


def test_a_jobs_command_prints_no_system_check_output(worker_env):
    import subprocess
    import sys

    from tests.conftest import ROOT

    # a real `manage.py jobs status`, as an operator runs it (call_command skips the checks)
    done = subprocess.run(
        [sys.executable, "manage.py", "jobs", "status", "--json"],
        cwd=ROOT,
        env=worker_env,  # the test database
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    assert done.returncode == 0, done.stderr
    assert "System check" not in done.stderr + done.stdout
    assert "jobs.W0" not in done.stderr + done.stdout
    assert "queues" in json.loads(done.stdout)
