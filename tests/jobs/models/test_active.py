"""jobs_activejob (jobs.models.active): the triggers keep it true for every way the ledger is
written, the relay reads the active jobs without reading the finished history, and the
workers' claim and finish are HOT updates of jobs_job (PostgreSQL)."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from jobs import ledger
from jobs.flow.relay import job_relay
from jobs.models import ActiveJob, Job, JobState
from tests.support import tasks

pytestmark = pytest.mark.django_db

# The job's columns that jobs_activejob copies: its own, but the key.
COPIED = tuple(f.name for f in ActiveJob._meta.concrete_fields if not f.primary_key)


def copy_of(job_id: uuid.UUID | str) -> dict | None:
    row = ActiveJob.objects.filter(job_id=job_id).values(*COPIED).first()
    return dict(row) if row else None


def ledger_columns(job_id: uuid.UUID | str) -> dict:
    return dict(Job.objects.filter(id=job_id).values(*COPIED).get())


def test_an_active_job_is_copied_while_active_and_leaves_when_it_ends(clean_redis):
    # given a job enqueued through the public API
    handle = tasks.prioritized.enqueue("k", "copied")
    assert copy_of(handle.id) == ledger_columns(handle.id)

    # when a worker claims it, its copy follows (state, lease)
    claimed = ledger.claim(job_id=handle.id, lease_seconds=30)
    assert claimed is not None
    copy = copy_of(handle.id)
    assert copy == ledger_columns(handle.id)
    assert copy is not None and copy["state"] == JobState.RUNNING

    # a write of no copied column leaves the copy as it was
    Job.objects.filter(id=handle.id).update(progress_done=3, progress_message="three")
    assert copy_of(handle.id) == ledger_columns(handle.id)

    # and the finish removes it
    owner = str(Job.objects.get(id=handle.id).lease_owner)
    assert ledger.succeed(
        job_id=handle.id, attempt=claimed.attempt, run_seconds=0.01, lease_owner=owner
    )
    assert copy_of(handle.id) is None


@pytest.mark.django_db(transaction=True)  # TRUNCATE: no deferred constraint checks pending
def test_a_copy_a_bulk_create_and_deletes_keep_the_copy_true(clean_redis):
    # given rows written by the ledger's COPY (a fan-out's, unpublished here so that no worker
    # moves them) and by the ORM in bulk
    prototype = Job(task_name="tests.fanned", queue="default", state=JobState.QUEUED)
    copied = [uuid.uuid4() for _ in range(30)]
    with transaction.atomic():
        ledger.insert_many(
            prototype=prototype,
            rows=[ledger.NewRow(id=i, args=[n], kwargs={}) for n, i in enumerate(copied)],
        )
    history = Job.objects.bulk_create(
        Job(task_name="tests.old", queue="default", state=JobState.SUCCEEDED) for _ in range(5)
    )
    waiting = Job.objects.bulk_create(
        Job(task_name="tests.new", queue="default", state=JobState.SCHEDULED) for _ in range(5)
    )
    mine = [*copied, *(job.id for job in history), *(job.id for job in waiting)]

    def copies() -> set[uuid.UUID]:
        return set(ActiveJob.objects.filter(job_id__in=mine).values_list("job_id", flat=True))

    # then every active one has its copy, no finished one has
    assert copies() == {*copied, *(job.id for job in waiting)}

    # deleting jobs (the ORM, retention) and emptying the table (TRUNCATE) take their copies
    Job.objects.filter(id__in=[job.id for job in waiting[:2]]).delete()
    assert copies() == {*copied, *(job.id for job in waiting[2:])}
    Job.objects.filter(id__in=[job.id for job in history]).delete()
    assert copies() == {*copied, *(job.id for job in waiting[2:])}
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE jobs_job CASCADE")
    assert copies() == set()


def test_an_ended_job_made_active_again_is_copied_again(clean_redis):
    job = Job.objects.create(task_name="tests.x", queue="default", state=JobState.CANCELLED)
    assert copy_of(job.id) is None
    Job.objects.filter(id=job.id).update(state=JobState.QUEUED)
    assert copy_of(job.id) == ledger_columns(job.id)


def fill_history(rows: int) -> None:
    """`rows` finished jobs written the way a busy week leaves them, by one INSERT."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO jobs_job (id, task_name, args, kwargs, queue, priority, idempotency_key,
                state, attempts, max_attempts, deliveries, crashes, progress_done,
                progress_message, error, failures, enqueued_at, published_at, started_at,
                finished_at, publish_options, trace_context)
            SELECT gen_random_uuid(), 'tests.old', '[]', '{}', 'default', 5, '', 'succeeded',
                1, 1, 1, 0, 0, '', '', '[]', now() - g * interval '1 second', now(), now(),
                now(), '{}', '{}'
            FROM generate_series(1, %s) g
            """,
            [rows],
        )
        cursor.execute("ANALYZE jobs_job")
        cursor.execute("ANALYZE jobs_activejob")


@pytest.mark.django_db(transaction=True)
def test_the_relays_reads_go_through_the_active_jobs_not_the_history(clean_redis):
    # given a ledger of 50,000 finished jobs and a few active ones
    fill_history(50_000)
    tasks.prioritized.enqueue("k", "waiting")
    now = timezone.now()

    # then each of the relay's reads of the active jobs reads jobs_job by its primary key
    reads = {
        "outbox": Job.objects.unpublished(),
        "due": Job.objects.due(now),
        "lost messages": ledger.waiting_but_due(now, timedelta(seconds=30), queue="default"),
        "lapsed leases": Job.objects.active_where(state=JobState.RUNNING, lease_expires_at__lt=now),
        "active": Job.objects.active(),
    }
    for name, queryset in reads.items():
        plan = queryset.explain()
        assert "Seq Scan on jobs_job" not in plan, f"{name}:\n{plan}"
        assert "jobs_job_pkey" in plan, f"{name}:\n{plan}"
    assert job_relay() >= 0  # and a whole sweep runs on this schema


def hot_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    updates, hot = after[0] - before[0], after[1] - before[1]
    assert updates > 0
    return hot / updates


def vacuumed() -> None:
    """jobs_job as autovacuum keeps it in production: the dead row versions earlier tests left
    (their rolled-back inserts, their updates) reclaimed, so that the pages this test's rows
    share have the room their fillfactor leaves."""
    with connection.cursor() as cursor:
        cursor.execute("VACUUM jobs_job")


def update_counts() -> tuple[int, int]:
    """jobs_job's UPDATEs and HOT UPDATEs as PostgreSQL counts them, this backend's included."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
    with connection.cursor() as cursor:  # a new transaction: the flushed figures
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'jobs_job'"
        )
        updates, hot = cursor.fetchone()
    return int(updates), int(hot)


@pytest.mark.django_db(transaction=True)
def test_a_claim_and_a_finish_are_hot_updates(clean_redis):
    # given 60 jobs enqueued through the public API, one at a time
    vacuumed()
    handles = [tasks.prioritized.enqueue("k", f"hot{n}") for n in range(60)]
    before = update_counts()

    # when each is claimed and finished by the ledger's own writes (what a worker runs)
    for handle in handles:
        claimed = ledger.claim(job_id=handle.id, lease_seconds=30)
        assert claimed is not None
        owner = str(Job.objects.values_list("lease_owner", flat=True).get(id=handle.id))
        assert ledger.succeed(
            job_id=handle.id, attempt=claimed.attempt, run_seconds=0.01, lease_owner=owner
        )

    # then at least 90 % of jobs_job's UPDATEs were HOT (no index entry written)
    assert hot_share(before, update_counts()) >= 0.9


@pytest.mark.django_db(transaction=True)
def test_successes_written_together_are_hot_updates(clean_redis):
    # given 64 jobs enqueued through the public API, one at a time (their rows share pages)
    vacuumed()
    handles = [tasks.prioritized.enqueue("k", f"together{n}") for n in range(64)]
    before = update_counts()

    # when a worker writes their short successes together, 32 in one UPDATE (jobs.worker.
    # finishes: each page's rows get their new versions in one transaction)
    now = timezone.now()
    successes = [ledger.Success(str(h.id), 0, str(uuid.uuid4()), now, now, 0.01) for h in handles]
    for first in (0, 32):
        assert ledger.succeed_unclaimed_many(successes[first : first + 32]) == {
            s.job_id for s in successes[first : first + 32]
        }

    # then each succeeded, and at least 90 % of the UPDATEs were HOT (the page kept room)
    rows = Job.objects.filter(id__in=[h.id for h in handles])
    assert set(rows.values_list("state", flat=True)) == {JobState.SUCCEEDED}
    assert hot_share(before, update_counts()) >= 0.9
