"""The bulk replay an operator starts from the admin (dead_letter_replay_many): what it sends,
what it skips and says why, and that a chunk that fails leaves nothing behind. Real Redis and
PostgreSQL, no worker: the replays wait in their queues."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from jobs import dead_letter_replay_many, ledger
from jobs.broker.queues import queue_depths
from jobs.core.exceptions import PayloadTooLarge
from jobs.models import DeadLetter, DeadLetterStatus, Job
from tests.support import tasks  # noqa: F401  (registers tests.prioritized)


def dead_letter(**fields: Any) -> DeadLetter:
    now = timezone.now()
    values = {
        "job_id_value": uuid.uuid4(),
        "task_name": "tests.prioritized",
        "args": ["k", "replayed"],
        "kwargs": {},
        "queue": "reports",
        "priority": 5,
        "exception_class": "ConnectionError",
        "exception_message": "down",
        "first_failed_at": now,
        "last_failed_at": now,
    }
    values.update(fields)
    return DeadLetter.objects.create(**values)


@pytest.fixture
def user(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("ines", password="not-used-here")


def test_a_bulk_replay_sends_what_fits_and_names_what_it_skipped(
    db, clean_redis, user, django_capture_on_commit_callbacks
):
    # given: replayable dead letters of one owner and two priorities, and among them one of
    # a task that no longer exists, one whose arguments no longer fit, one already replayed
    fine = [dead_letter(args=["k", f"label-{i}"], owner=user, priority=i % 2 + 3) for i in range(6)]
    fine.append(dead_letter(args=[], kwargs={"key": "k", "label": "by-name"}))
    unknown = dead_letter(task_name="tests.gone_for_good")
    unfit = dead_letter(args=["k", "label", "one too many"])
    done = dead_letter(status=DeadLetterStatus.REPLAYED)

    # when (its messages go once the chunk's transaction commits)
    with django_capture_on_commit_callbacks(execute=True):
        outcome = dead_letter_replay_many(
            queryset=DeadLetter.objects.filter(pk__in=[r.pk for r in [*fine, unknown, unfit, done]])
        )

    # then: each fitting one is a new job with its arguments, priority, queue and owner, linked
    # both ways and waiting in its queue
    assert outcome.done == len(fine) and len(outcome.job_ids) == len(fine)
    for row in fine:
        row.refresh_from_db()
        job = Job.objects.get(replay_of=row)
        assert row.status == DeadLetterStatus.REPLAYED and row.replayed_job_id == job.id
        assert row.resolved_at is not None
        assert (job.args, job.kwargs, job.priority, job.queue, job.owner_id) == (
            row.args,
            row.kwargs,
            row.priority,
            row.queue,
            row.owner_id,
        )
    assert queue_depths(["reports"])["reports"] == len(fine)
    # and the others are still dead, each with its reason
    assert outcome.skipped == 2
    assert any("tests.gone_for_good" in error for error in outcome.errors)
    assert any(f"dead letter {unfit.pk}:" in error for error in outcome.errors)
    for row in (unknown, unfit):
        row.refresh_from_db()
        assert row.status == DeadLetterStatus.DEAD and not Job.objects.filter(replay_of=row)
    done.refresh_from_db()
    assert done.replayed_job_id is None and not Job.objects.filter(replay_of=done)


def test_a_chunk_that_fails_leaves_nothing_half_written(db, clean_redis):
    # given: a dead letter that replays, then one whose arguments are now over the size limit
    fine = dead_letter()
    huge = dead_letter(args=["k", "x" * 70_000])

    # when
    with pytest.raises(PayloadTooLarge):
        dead_letter_replay_many(queryset=DeadLetter.objects.filter(pk__in=[fine.pk, huge.pk]))

    # then: neither was replayed, no job was written and nothing was sent
    for row in (fine, huge):
        row.refresh_from_db()
        assert row.status == DeadLetterStatus.DEAD
    assert not Job.objects.filter(replay_of__in=[fine, huge]).exists()
    assert queue_depths(["reports"])["reports"] == 0


def test_rows_another_operator_holds_are_skipped(transactional_db, clean_redis):
    # given: three dead letters, one of them locked by another operator's replay
    rows = [dead_letter(args=["k", f"label-{i}"]) for i in range(3)]
    held, let_go = threading.Event(), threading.Event()

    def other_operator() -> None:
        try:
            with transaction.atomic():
                DeadLetter.objects.select_for_update().get(pk=rows[1].pk)
                held.set()
                let_go.wait(timeout=30)
        finally:
            connection.close()

    thread = threading.Thread(target=other_operator)
    thread.start()
    try:
        assert held.wait(timeout=30)

        # when
        outcome = dead_letter_replay_many(
            queryset=DeadLetter.objects.filter(pk__in=[row.pk for row in rows])
        )
    finally:
        let_go.set()
        thread.join()

    # then: the two free ones were replayed; the held one was left to its operator
    assert (outcome.done, outcome.skipped) == (2, 1)
    statuses = [DeadLetter.objects.get(pk=row.pk).status for row in rows]
    assert statuses == [DeadLetterStatus.REPLAYED, DeadLetterStatus.DEAD, DeadLetterStatus.REPLAYED]


def test_a_row_resolved_after_the_listing_is_not_replayed_again(db):
    # given: a chunk's pks as listed, one of them replayed by another operator since
    dead, replayed = dead_letter(), dead_letter()
    DeadLetter.objects.filter(pk=replayed.pk).update(status=DeadLetterStatus.REPLAYED)

    # when: the chunk is locked for its replay
    with transaction.atomic():
        rows = ledger.dead_letters_to_replay(pks=[dead.pk, replayed.pk])

    # then: only the dead one is the replay's
    assert [row.pk for row in rows] == [dead.pk]


def _scans_of(plan: dict[str, Any], table: str) -> list[dict[str, Any]]:
    found = [plan] if plan.get("Relation Name") == table else []
    for child in plan.get("Plans", []):
        found += _scans_of(child, table)
    return found


@pytest.mark.skipif(connection.vendor != "postgresql", reason="a PostgreSQL plan")
def test_a_chunks_lock_reads_its_own_rows_whatever_the_statistics_say(db):
    # given: 10,000 unresolved dead letters written since the table's statistics were taken
    # (as after a burst of failures), and a bulk replay's first chunk of 1,000
    now = timezone.now()
    DeadLetter.objects.bulk_create(
        DeadLetter(
            job_id_value=uuid.uuid4(),
            task_name="tests.prioritized",
            args=["k", str(i)],
            queue="reports",
            exception_class="ConnectionError",
            first_failed_at=now,
            last_failed_at=now,
        )
        for i in range(10_000)
    )
    chunk = list(DeadLetter.objects.order_by("pk").values_list("pk", flat=True)[:1_000])
    with CaptureQueriesContext(connection) as captured, transaction.atomic():
        assert len(ledger.dead_letters_to_replay(pks=chunk)) == 1_000
    (lock,) = [q["sql"] for q in captured.captured_queries if "FOR UPDATE" in q["sql"]]

    # when: PostgreSQL runs that lock again, with its plan
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + lock)
        (plan,) = cursor.fetchone()[0]

    # then: it read the chunk's 1,000 rows, not every unresolved dead letter (a scan of the
    # status index filtered by the chunk's pks: quadratic in the dead letters over a bulk
    # replay, 28 ms a chunk at 10,000)
    (scan,) = _scans_of(plan["Plan"], DeadLetter._meta.db_table)
    assert scan["Actual Rows"] == 1_000
    assert scan.get("Rows Removed by Filter", 0) == 0, scan
