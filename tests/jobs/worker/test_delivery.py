"""Delivery on real workers: cluster-wide rate limits, priorities, pickle refused, duplicates."""

from __future__ import annotations

from kombu import Exchange, Producer, Queue

from config.celery import app as celery_app
from jobs.broker.redis import redis_client, redis_text
from jobs.models import Job, JobState
from jobs.worker.outcomes import DELIVERIES
from tests.conftest import marks, wait_until
from tests.support import tasks


def test_rate_limit_holds_across_two_worker_processes(worker, start_worker, unique):
    second = start_worker("rate", queues="default", concurrency=2)
    try:
        handles = [tasks.rate_limited.enqueue(unique) for _ in range(160)]
        first = wait_until(lambda: marks(unique), what="the first rate-limited job")[0][0]
        wait_until(
            lambda: marks(unique) and marks(unique)[-1][0] >= first + 5.5,
            timeout=30,
            what="5 s of rate-limited runs",
        )
        started = [t for t, _ in marks(unique) if first <= t < first + 5.0]

        assert 90 <= len(started) <= 110, len(started)  # 20/s over 5 s
        wait_until(
            lambda: (
                Job.objects.filter(id__in=[h.id for h in handles], state=JobState.SUCCEEDED).count()
                == 160
            ),
            timeout=60,
            what="all rate-limited jobs to finish",
        )
        attempts = set(
            Job.objects.filter(id__in=[h.id for h in handles]).values_list("attempts", flat=True)
        )
        assert attempts == {1}  # waiting for a token spends no attempt
        assert "tests.rate_limited" in second.output()  # the second process took work too
    finally:
        second.stop()


def test_higher_priority_starts_first_in_a_backlog(
    start_worker, clean_redis, transactional_db, unique
):
    # given a backlog on `reports`, which no worker consumes yet
    low = [tasks.prioritized.using(priority=1).enqueue(unique, f"low{n}") for n in range(8)]
    high = [tasks.prioritized.using(priority=9).enqueue(unique, f"high{n}") for n in range(4)]

    # when one single-process worker starts on it
    worker = start_worker("priority", queues="reports", concurrency=1)
    try:
        wait_until(lambda: len(marks(unique)) == len(low) + len(high), what="backlog to drain")
    finally:
        worker.stop()

    # then every high-priority job ran before any low one
    order = [label for _, label in marks(unique)]
    assert all(label.startswith("high") for label in order[:4]), order


def test_pickled_message_is_refused_and_not_executed(worker, unique):
    with celery_app.connection_for_write() as conn:
        producer = Producer(
            conn, exchange=Exchange("default"), routing_key="default", serializer="pickle"
        )
        producer.publish(
            [[unique, "pickled"], {}, {}],
            headers={
                "task": "tests.record",
                "id": "00000000-0000-4000-8000-000000000001",
                "lang": "py",
                "argsrepr": "",
                "kwargsrepr": "",
            },
            declare=[Queue("default", Exchange("default"), routing_key="default")],
        )
    # A JSON job sent after it proves the worker got past the pickled message.
    after = tasks.record.enqueue(unique, label="json")
    wait_until(lambda: Job.objects.filter(id=after.id, state=JobState.SUCCEEDED).exists())

    assert [label for _, label in marks(unique)] == ["json"]
    assert "pickle" in worker.output().lower()


def dropped_deliveries() -> int:
    """Deliveries the workers dropped (a duplicate, a finished job's copy), as counted in
    Redis: every outcome but a run's (claimed, deferred) and a requeue."""
    counts = redis_client().hgetall(DELIVERIES)
    return sum(
        int(count)
        for outcome, count in counts.items()
        if redis_text(outcome) not in ("claimed", "deferred", "requeued")
    )


def test_duplicate_message_of_a_finished_job_is_dropped(worker, unique):
    handle = tasks.record.enqueue(unique, label="once")
    wait_until(lambda: Job.objects.filter(id=handle.id, state=JobState.SUCCEEDED).exists())
    before = dropped_deliveries()

    # the same message delivered again (e.g. Redis visibility timeout, relay race)
    tasks.record.apply_async(
        [unique], {"label": "once"}, task_id=handle.id, queue="default", _backlot_internal=True
    )
    marker = tasks.record.enqueue(unique, label="after")
    wait_until(lambda: Job.objects.filter(id=marker.id, state=JobState.SUCCEEDED).exists())

    assert [label for _, label in marks(unique)] == ["once", "after"]
    # delivered and dropped: by its run's Redis record (DEFER_CLAIM, the row untouched) or by
    # the claim, which reads the finished row
    wait_until(
        lambda: dropped_deliveries() == before + 1, what="the duplicate's drop to be counted"
    )
    assert Job.objects.get(id=handle.id).state == JobState.SUCCEEDED


def test_message_sent_by_name_is_adopted_into_the_ledger(worker, unique):
    result = celery_app.send_task("tests.record", args=[unique, "raw"], queue="default")

    job = wait_until(
        lambda: Job.objects.filter(id=result.id, state=JobState.SUCCEEDED).first(),
        what="the raw message to run",
    )
    assert job.task_name == "tests.record" and job.args == [unique, "raw"] and job.attempts == 1
    assert [label for _, label in marks(unique)] == ["raw"]
