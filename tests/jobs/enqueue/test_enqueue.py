"""Enqueue: the ledger row, on-commit publishing, delays and de-duplication.

These jobs go to `reports`, which the session worker leaves alone, so what reaches the broker
stays there to be counted.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from datetime import timedelta

import pytest
from django.db import IntegrityError, connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from jobs import enqueue_many
from jobs.broker import unanswered
from jobs.broker.queues import queue_keys as broker_queue_keys
from jobs.broker.redis import redis_client
from jobs.enqueue import submit
from jobs.flow.relay import job_relay
from jobs.models import IdempotencyRecord, Job, JobState
from tests.conftest import ROOT
from tests.support import tasks

pytestmark = pytest.mark.django_db(transaction=True)


def messages_waiting(queue: str = "reports") -> int:
    client = redis_client()
    return sum(client.llen(key) for key in broker_queue_keys(queue))


def test_enqueue_writes_the_ledger_row_and_publishes(clean_redis, admin_user):
    handle = tasks.prioritized.using(priority=8, owner=admin_user, idempotency_key="o-1").enqueue(
        "k", label="a"
    )

    job = Job.objects.get(id=handle.id)
    assert handle.created
    assert (
        job.task_name == "tests.prioritized" and job.args == ["k"] and job.kwargs == {"label": "a"}
    )
    assert job.state == JobState.QUEUED and job.queue == "reports" and job.priority == 8
    assert job.owner == admin_user and job.idempotency_key == "o-1"
    assert job.max_attempts == tasks.prioritized.policy.max_attempts and job.attempts == 0
    assert job.published_at is not None
    assert messages_waiting() == 1
    assert handle.status_url == f"/api/jobs/{handle.id}/"


def test_an_enqueue_writes_the_ledger_once(clean_redis):
    # when a job is enqueued outside a transaction (autocommit: its INSERT commits alone)
    with CaptureQueriesContext(connection) as queries:
        handle = tasks.prioritized.enqueue("k", "once")

    # then its one write is the INSERT of a row already marked published; the message is out
    writes = [
        q["sql"].lstrip().split(" ", 1)[0].upper()
        for q in queries.captured_queries
        if q["sql"].lstrip().split(" ", 1)[0].upper() in ("INSERT", "UPDATE", "DELETE")
    ]
    assert writes == ["INSERT"]
    assert Job.objects.get(id=handle.id).published_at is not None
    assert messages_waiting() == 1


def test_a_publish_that_fails_leaves_the_job_in_the_outbox(clean_redis, monkeypatch):
    # given a broker that refuses the publish (jobs.broker.broker.publish answers False)
    monkeypatch.setattr("jobs.broker.broker.publish", lambda **kwargs: False)

    # when a job is enqueued
    handle = tasks.prioritized.enqueue("k", "refused")

    # then its row waits unpublished, and the relay's outbox sweep publishes it
    job = Job.objects.get(id=handle.id)
    assert job.state == JobState.QUEUED and job.published_at is None
    monkeypatch.undo()
    Job.objects.filter(id=handle.id).update(enqueued_at=timezone.now() - timedelta(minutes=1))
    assert job_relay() == 1 and messages_waiting() == 1


def test_a_message_redis_refuses_after_the_enqueue_returned_is_sent_again_by_the_relay(
    clean_redis, caplog
):
    # given: the queue's lists taken by values of another type, so Redis refuses the LPUSH
    client = redis_client()
    for key in broker_queue_keys("reports"):
        client.set(key, "not a list")

    # when a job is enqueued: its row is marked published, and Redis's reply is not waited for
    with caplog.at_level("WARNING", logger="jobs.broker.unanswered"):
        handle = tasks.prioritized.enqueue("k", "refused late")
        unanswered.flush()
    client.delete(*broker_queue_keys("reports"))

    # then the refusal is logged, the row says published, and no message waits
    assert "Redis refused a job's message: WRONGTYPE" in caplog.text
    assert Job.objects.get(id=handle.id).published_at is not None
    assert messages_waiting() == 0
    # ... until the relay's reconcile finds it missing from Redis (published MISSING_AFTER ago)
    earlier = timezone.now() - timedelta(minutes=1)
    Job.objects.filter(id=handle.id).update(enqueued_at=earlier, published_at=earlier)
    job_relay()
    assert messages_waiting() == 1


def test_a_process_that_enqueues_and_exits_leaves_every_message_in_redis(clean_redis, worker_env):
    # when a process (a management command, a script) enqueues jobs and exits at once
    script = (
        "import django; django.setup()\n"
        "from tests.support import tasks\n"
        "ids = [tasks.prioritized.enqueue('k', f'exit-{n}').id for n in range(50)]\n"
        "print(','.join(ids))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**worker_env, "DJANGO_SETTINGS_MODULE": "config.settings"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    # then every job's message is in Redis (the replies it did not wait for are read at exit)
    assert done.returncode == 0, done.stderr[-3000:]
    ids = done.stdout.strip().splitlines()[-1].split(",")
    assert (
        len(ids) == 50 and Job.objects.filter(id__in=ids, published_at__isnull=False).count() == 50
    )
    assert messages_waiting() == 50


def test_a_fan_out_writes_its_rows_once(clean_redis):
    # when many jobs are enqueued at once
    with CaptureQueriesContext(connection) as queries:
        ids = enqueue_many(tasks.prioritized, [(("k", f"bulk-{n}"), {}) for n in range(5)])

    # then their rows are copied already marked published: no UPDATE after the publish
    assert not [q for q in queries.captured_queries if "UPDATE" in q["sql"].upper()]
    assert Job.objects.filter(id__in=ids, published_at__isnull=False).count() == 5
    assert messages_waiting() == 5


def test_a_fan_out_the_broker_takes_in_part_leaves_the_rest_in_the_outbox(clean_redis, monkeypatch):
    # given a broker that takes the first 2 messages of 5 and fails
    monkeypatch.setattr("jobs.broker.broker.publish_many", lambda **kwargs: 2)

    # when they are enqueued
    ids = enqueue_many(tasks.prioritized, [(("k", f"part-{n}"), {}) for n in range(5)])

    # then the 3 the broker did not take wait in the outbox, in order
    unpublished = Job.objects.filter(id__in=ids, published_at__isnull=True)
    assert sorted(str(i) for i in unpublished.values_list("id", flat=True)) == sorted(ids[2:])


def test_rollback_sends_nothing(clean_redis):
    with pytest.raises(RuntimeError), transaction.atomic():
        tasks.prioritized.enqueue("k", "a")
        raise RuntimeError("the view failed after enqueue")

    assert Job.objects.count() == 0
    assert messages_waiting() == 0


def test_publish_waits_for_commit(clean_redis):
    with transaction.atomic():
        handle = tasks.prioritized.enqueue("k", "a")
        assert messages_waiting() == 0  # not before commit
    assert messages_waiting() == 1
    assert Job.objects.get(id=handle.id).published_at is not None


def test_plain_celery_delay_goes_through_the_ledger(clean_redis):
    result = tasks.prioritized.delay("k", label="plain")

    job = Job.objects.get(id=result.id)
    assert job.state == JobState.QUEUED and job.kwargs == {"label": "plain"}
    assert messages_waiting() == 1


def test_short_delay_is_scheduled_in_the_broker(clean_redis):
    handle = tasks.prioritized.using(delay=30).enqueue("k", "a")

    job = Job.objects.get(id=handle.id)
    assert job.state == JobState.SCHEDULED and job.scheduled_for is not None
    assert timedelta(seconds=29) < job.scheduled_for - job.enqueued_at < timedelta(seconds=31)
    assert job.published_at is not None


def test_long_delay_waits_in_the_ledger_until_due(clean_redis, settings):
    handle = tasks.prioritized.using(delay=3600).enqueue("k", "a")
    job = Job.objects.get(id=handle.id)
    assert job.state == JobState.SCHEDULED and job.published_at is None
    assert job_relay() == 0  # not due yet
    assert messages_waiting() == 0

    Job.objects.filter(id=handle.id).update(scheduled_for=timezone.now() - timedelta(seconds=1))
    assert job_relay() == 1

    assert messages_waiting() == 1
    assert Job.objects.get(id=handle.id).published_at is not None


@pytest.mark.parametrize("bad", [{"priority": 10}, {"priority": -1}, {"delay": -5}])
def test_bad_options_are_refused(clean_redis, bad):
    with pytest.raises(ValueError):
        tasks.prioritized.enqueue("k", "a", **bad)
    assert Job.objects.count() == 0 and messages_waiting() == 0


def test_same_key_while_waiting_returns_the_first_job(clean_redis):
    first = tasks.prioritized.using(idempotency_key="order-7").enqueue("k", "a")
    second = tasks.prioritized.using(idempotency_key="order-7").enqueue("k", "a")

    assert second.id == first.id and not second.created
    assert Job.objects.count() == 1 and messages_waiting() == 1


def test_same_key_twice_in_one_transaction_keeps_the_transaction_usable(clean_redis):
    # when: the caller's own transaction enqueues a key, again, then goes on writing
    with transaction.atomic():
        first = tasks.prioritized.using(idempotency_key="order-8").enqueue("k", "a")
        second = tasks.prioritized.using(idempotency_key="order-8").enqueue("k", "a")
        after = tasks.prioritized.enqueue("k", "b")

    # then: one job for the key, the transaction committed everything it did
    assert second.id == first.id and not second.created
    assert set(Job.objects.values_list("id", flat=True)) == {first.job().id, after.job().id}
    assert messages_waiting() == 2


def test_same_key_from_two_concurrent_transactions_makes_one_job(clean_redis):
    # given: two threads inside their own transactions, the first holding the key uncommitted
    import threading

    inserted = threading.Event()
    handles: dict[str, object] = {}

    def first() -> None:
        try:
            with transaction.atomic():
                handles["first"] = tasks.prioritized.using(idempotency_key="order-9").enqueue(
                    "k", "a"
                )
                inserted.set()
                # the second enqueue waits on the key's row until this commits
                handles["second waited"] = not second_done.wait(timeout=1.0)
        finally:
            inserted.set()
            connection.close()

    second_done = threading.Event()

    def second() -> None:
        try:
            assert inserted.wait(timeout=30)
            handles["second"] = tasks.prioritized.using(idempotency_key="order-9").enqueue("k", "a")
        finally:
            second_done.set()
            connection.close()

    # when
    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    # then: the second returned the first's job once it committed; one row, one message
    one, two = handles["first"], handles["second"]
    assert handles["second waited"], "the second enqueue did not wait for the first's commit"
    assert two.id == one.id and not two.created and one.created  # type: ignore[attr-defined]
    assert Job.objects.count() == 1 and messages_waiting() == 1


def test_keys_are_scoped_per_task(clean_redis):
    a = tasks.prioritized.using(idempotency_key="order-7").enqueue("k", "a")
    b = tasks.add.using(idempotency_key="order-7").enqueue(1, 2)
    assert a.id != b.id


def test_key_holds_after_success_for_the_ttl_then_frees(clean_redis, settings):
    first = tasks.prioritized.using(idempotency_key="pay-1").enqueue("k", "a")
    Job.objects.filter(id=first.id).update(state=JobState.SUCCEEDED, finished_at=timezone.now())
    assert tasks.prioritized.using(idempotency_key="pay-1").enqueue("k", "a").id == first.id

    ttl = settings.BACKLOT["IDEMPOTENCY_TTL"]
    Job.objects.filter(id=first.id).update(finished_at=timezone.now() - timedelta(seconds=ttl + 1))
    again = tasks.prioritized.using(idempotency_key="pay-1").enqueue("k", "a")

    assert again.id != first.id and again.created
    assert IdempotencyRecord.objects.get(key="tests.prioritized:pay-1").job_id == again.job().id


def test_key_of_a_dead_job_can_be_enqueued_again(clean_redis):
    first = tasks.prioritized.using(idempotency_key="pay-2").enqueue("k", "a")
    Job.objects.filter(id=first.id).update(state=JobState.DEAD, finished_at=timezone.now())

    again = tasks.prioritized.using(idempotency_key="pay-2").enqueue("k", "a")

    assert again.created and again.id != first.id


def test_a_caller_chosen_job_id_names_the_job(clean_redis):
    # given: an id chosen before the enqueue (a view writes it on its own row first)
    chosen = uuid.uuid4()

    # when: the job is enqueued with it, then again under the same id
    handle = tasks.prioritized.using(job_id=chosen, idempotency_key="chosen-1").enqueue("k", "a")

    # then: the job, its row and its message carry that id; an id is one job's only
    assert handle.id == str(chosen) and handle.created
    assert Job.objects.get(id=chosen).args == ["k", "a"] and messages_waiting() == 1
    with pytest.raises(IntegrityError), transaction.atomic():
        tasks.prioritized.using(job_id=str(chosen)).enqueue("k", "b")
    with pytest.raises(ValueError, match="not both"):
        submit.enqueue(task=tasks.prioritized, args=["k"], job_id=chosen, task_id=str(chosen))
    assert Job.objects.count() == 1 and messages_waiting() == 1


def test_untracked_jobs_refuse_idempotency_keys(clean_redis):
    with pytest.raises(ValueError, match="track=False"):
        tasks.record_untracked.using(idempotency_key="x").enqueue("k")


def test_message_headers_carry_only_a_short_masked_copy_of_the_arguments(clean_redis):
    import json as jsonlib

    tasks.prioritized.enqueue("jane.doe@example.com", label="x" * 500)

    raw = redis_client().lrange(broker_queue_keys("reports")[4], 0, -1)[0]
    headers = jsonlib.loads(raw)["headers"]
    assert "jane.doe@" not in headers["argsrepr"] and "j***@example.com" in headers["argsrepr"]
    assert len(headers["kwargsrepr"]) <= 120


def test_a_row_alongside_is_inserted_in_the_jobs_own_statement(clean_redis, unique):
    from django.contrib.auth.models import Group

    # given: a new row of the caller's, not saved, and no transaction open
    group = Group(name=f"{unique}-a")

    # when: the job is enqueued with it alongside, then another with a key
    with CaptureQueriesContext(connection) as queries:
        handle = tasks.prioritized.using(alongside=group).enqueue("k", group.name)
    keyed = Group(name=f"{unique}-b")
    with CaptureQueriesContext(connection) as keyed_queries:
        tasks.prioritized.using(alongside=keyed, idempotency_key=unique).enqueue("k", "b")

    # then: each is one statement (no BEGIN/COMMIT around two), the rows are saved with
    # their keys set, and the jobs are in the ledger and in Redis
    assert len(queries) == 1 and len(keyed_queries) == 1
    assert Group.objects.get(pk=group.pk).name == f"{unique}-a" and not group._state.adding
    assert Group.objects.filter(pk=keyed.pk, name=f"{unique}-b").exists()
    assert Job.objects.get(id=handle.id).args == ["k", group.name] and messages_waiting() == 2


def test_a_row_alongside_is_not_written_when_its_job_is_not(clean_redis, unique):
    from django.contrib.auth.models import Group

    # given: a job id already taken, so the next job's INSERT fails
    taken = uuid.uuid4()
    tasks.prioritized.using(job_id=taken).enqueue("k", "first")

    # when: a job under that id is enqueued with a row alongside (outside a transaction)
    with pytest.raises(IntegrityError):
        tasks.prioritized.using(job_id=taken, alongside=Group(name=unique)).enqueue("k", "b")
    # and another inside a transaction that rolls back
    with pytest.raises(RuntimeError), transaction.atomic():
        tasks.prioritized.using(alongside=Group(name=f"{unique}-rb")).enqueue("k", "c")
        raise RuntimeError("the view failed after the enqueue")

    # then: neither row was written, nor a second job or message
    assert not Group.objects.filter(name__startswith=unique).exists()
    assert Job.objects.count() == 1 and messages_waiting() == 1


def test_a_row_alongside_is_written_when_the_key_returns_another_job(clean_redis, unique):
    from django.contrib.auth.models import Group

    first = tasks.prioritized.using(idempotency_key=unique).enqueue("k", "a")

    group = Group(name=unique)
    again = tasks.prioritized.using(idempotency_key=unique, alongside=group).enqueue("k", "a")

    assert again.id == first.id and not again.created
    assert Group.objects.filter(pk=group.pk, name=unique).exists()
    assert Job.objects.count() == 1 and messages_waiting() == 1


def test_alongside_refuses_what_one_statement_cannot_insert(clean_redis, unique):
    from django.contrib.auth.models import Group

    saved = Group.objects.create(name=unique)
    with pytest.raises(ValueError, match="already saved"):
        tasks.prioritized.using(alongside=saved).enqueue("k", "a")
    with pytest.raises(ValueError, match="new model instance, not dict"):
        tasks.prioritized.using(alongside={"name": "x"}).enqueue("k", "a")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="track=False"):
        tasks.record_untracked.using(alongside=Group(name=f"{unique}-u")).enqueue("k")
    assert Job.objects.count() == 0 and messages_waiting() == 0
    assert list(Group.objects.values_list("name", flat=True)) == [unique]
