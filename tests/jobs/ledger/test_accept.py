"""jobs.ledger.bulk.insert_many: the COPY of a fan-out's rows (its constant columns written
once as COPY text, per row only id, args, kwargs and replay link) stores what the ORM's own
INSERT of the same jobs stores, field for field, awkward values included (PostgreSQL); the
published mark and the claim agree on when a row left the outbox."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from jobs import ledger
from jobs.models import DeadLetter, Job, JobState

pytestmark = pytest.mark.django_db

# Values COPY's text format must escape (backslash, tab, newline, carriage return, and the
# backslash of a JSON escape) or the JSON text carries escaped (unicode, quotes).
AWKWARD: list[tuple[list[Any], dict[str, Any]]] = [
    ([], {}),
    (["tab\there", "new\nline", "cr\rback\\slash", 'say "hi"'], {"k\\ey": "\t"}),
    (["héllo ☃ 𝄞 日本", {"名前": ["Zoë", "🙂"]}], {"nested": [[[{"a": None}]], True]}),
    ([10**30, -(2**63), 1.5], {"big": 2**64 + 1}),  # (jsonb keeps no -0.0, no 1e300 form)
    (["\\N", "\\.", "%s %(x)s"], {"\\N": "\\\\N"}),
]


def the_columns(job: Job) -> dict[str, Any]:
    """Every concrete column of a stored job but its id."""
    return {
        f.attname: getattr(job, f.attname) for f in Job._meta.concrete_fields if f.attname != "id"
    }


def test_the_copy_stores_what_the_orms_insert_stores() -> None:
    assert connection.vendor == "postgresql"
    # given: a prototype whose constant columns hold awkward text too
    now = timezone.now()
    letter = DeadLetter.objects.create(
        job_id_value=str(uuid.uuid4()),
        task_name="tests.add",
        args=[1],
        kwargs={},
        queue="default",
        exception_class="ConnectionError",
        exception_message="down",
        first_failed_at=now,
        last_failed_at=now,
    )
    prototype = Job(
        task_name="tests.add",
        queue="default",
        priority=7,
        state=JobState.QUEUED,
        max_attempts=3,
        enqueued_at=now,
        published_at=now,
        trace_context={"traceparent": "00-abc\t\\def\n-01", "baggage": "naïve=ü"},
    )
    links = [None, letter.id, None, None, letter.id]
    copied = [
        ledger.NewRow(uuid.uuid4(), args, kwargs, link)
        for (args, kwargs), link in zip(AWKWARD, links, strict=True)
    ]

    # when: the rows are COPYed, and the same jobs inserted by the ORM
    ledger.insert_many(prototype=prototype, rows=copied)
    shared = {
        f.attname: getattr(prototype, f.attname)
        for f in Job._meta.concrete_fields
        if f.attname not in ("id", "args", "kwargs", "replay_of_id")
    }
    inserted = Job.objects.bulk_create(
        [
            Job(**shared, id=uuid.uuid4(), args=r.args, kwargs=r.kwargs, replay_of_id=r.replay_of)
            for r in copied
        ]
    )

    # then: row for row, every column the same, the arguments as given
    for row, orms in zip(copied, inserted, strict=True):
        ours = Job.objects.get(id=row.id)
        assert the_columns(ours) == the_columns(Job.objects.get(id=orms.id))
        assert (ours.args, ours.kwargs, ours.replay_of_id) == (row.args, row.kwargs, row.replay_of)


def test_the_single_insert_stores_what_the_orms_insert_stores(admin_user) -> None:
    # given: jobs with awkward arguments, one holding an idempotency key, each with every
    # column a plain enqueue sets (jobs.ledger.binding binds their values on the server)
    now = timezone.now()
    jobs = [
        Job(
            id=uuid.uuid4(),
            task_name="tests.add",
            args=args,
            kwargs=kwargs,
            queue="default",
            priority=9,
            owner=admin_user,
            idempotency_key="k\tey %s" if n == 0 else "",
            state=JobState.QUEUED,
            max_attempts=2**31 - 1,
            enqueued_at=now,
            published_at=now,
            progress_total=2**40,
            publish_options={"time_limit": 1.5, "headers": {"x": "\\N"}},
            trace_context={"traceparent": "00-abc\t\\def\n-01", "baggage": "naïve=ü"},
        )
        for n, (args, kwargs) in enumerate(AWKWARD)
    ]

    # when: each inserted by the ledger (the first holding its key), and the same jobs by the ORM
    assert (
        ledger.insert_holding_key(
            job=jobs[0], key=jobs[0].idempotency_key, ttl=timedelta(hours=1), now=now
        )
        is None
    )
    for job in jobs[1:]:
        ledger.insert(job)
    copies = Job.objects.bulk_create(
        [Job(**{**the_columns(job), "id": uuid.uuid4()}) for job in jobs]
    )

    # then: column for column the same
    for job, copy in zip(jobs, copies, strict=True):
        ours = Job.objects.get(id=job.id)
        assert the_columns(ours) == the_columns(Job.objects.get(id=copy.id))
        assert (ours.args, ours.kwargs) == (job.args, job.kwargs)


def queued(now: Any) -> Job:
    """A new queued job of tests.add, unsaved."""
    return Job(
        id=uuid.uuid4(),
        task_name="tests.add",
        queue="default",
        state=JobState.QUEUED,
        enqueued_at=now,
    )


def test_the_single_insert_prepares_no_statement_on_the_server(settings) -> None:
    # given: a connection that would prepare every statement it binds on the server at once
    # (psycopg's prepare_threshold 0; PgBouncer in transaction mode cannot hold them) and
    # DEBUG's query log on
    settings.DEBUG = True
    connection.ensure_connection()
    threshold = connection.connection.prepare_threshold
    connection.connection.prepare_threshold = 0
    try:
        # when: jobs are inserted, plain and holding a key
        now = timezone.now()
        for n in range(3):
            ledger.insert(queued(now))
            held = ledger.insert_holding_key(
                job=queued(now), key=f"key {n}", ttl=timedelta(hours=1), now=now
            )
            assert held is None
        logged = [q["sql"] for q in connection.queries if "INSERT INTO" in q["sql"]]

        # then: nothing prepared, every INSERT in the query log (its values as $1, $2...)
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_prepared_statements")
            assert cursor.fetchone()[0] == 0
    finally:
        connection.connection.prepare_threshold = threshold
    assert len(logged) == 6
    assert all('INSERT INTO "jobs_job"' in sql for sql in logged)


def test_a_copy_of_more_than_one_statements_rows_stores_them_all() -> None:
    # given: more rows than one write of the COPY carries
    now = timezone.now()
    prototype = Job(task_name="tests.add", queue="default", state=JobState.QUEUED, enqueued_at=now)
    rows = [ledger.NewRow(uuid.uuid4(), [n, n], {}) for n in range(ledger.BULK_BATCH * 2 + 7)]

    # when
    ledger.insert_many(prototype=prototype, rows=rows)

    # then: each stored once, with its own arguments
    stored = dict(Job.objects.filter(id__in=[r.id for r in rows]).values_list("id", "args"))
    assert stored == {r.id: [n, n] for n, r in enumerate(rows)}


@pytest.mark.parametrize("many", [False, True])
def test_a_published_mark_skips_a_row_claimed_since_its_message_was_sent(many: bool) -> None:
    # RabbitMQ: rows are marked after the broker's confirm, and a fast worker may have claimed
    # the job, failed it and put it back in the outbox for its retry before the mark lands
    now = timezone.now()
    sent = Job.objects.create(task_name="tests.add", state=JobState.QUEUED, attempts=0)
    retried = Job.objects.create(
        task_name="tests.add", state=JobState.RETRYING, attempts=1, scheduled_for=now
    )
    ids = [sent.id, retried.id] if many else [retried.id]

    marked = ledger.mark_published(ids, now=now, attempts=0)

    assert marked == (1 if many else 0)
    retried.refresh_from_db()
    assert retried.published_at is None  # the relay still sends the retry when due
    assert Job.objects.due(now).filter(id=retried.id).exists()
    if many:
        sent.refresh_from_db()
        assert sent.published_at == now


@pytest.mark.parametrize("published", [False, True], ids=["unmarked", "marked"])
def test_a_claim_marks_a_row_whose_published_mark_has_not_landed(published: bool) -> None:
    # RabbitMQ: a worker may claim the job before the broker's confirm marks its row; the mark
    # then skips it (above), and the claim says the message left the outbox
    sent_at = timezone.now() - timedelta(seconds=5)
    job = Job.objects.create(
        task_name="tests.add", state=JobState.QUEUED, published_at=sent_at if published else None
    )

    claimed = ledger.claim(job_id=str(job.id), lease_seconds=30)
    marked = ledger.mark_published([job.id], attempts=0)

    assert claimed is not None and marked == 0
    job.refresh_from_db()
    assert job.state == JobState.RUNNING and job.published_at is not None
    if published:
        assert job.published_at == sent_at  # a row marked already keeps its mark
    else:
        assert job.published_at == job.last_started_at  # the claim's time


def test_new_job_builds_the_row_job_init_builds_and_stores_it_alike(admin_user) -> None:
    # given the values of a plain enqueue (attnames), and the same row built by Job(...)
    now = timezone.now()
    values = {
        "task_name": "tests.add",
        "args": [1, "two"],
        "kwargs": {"k": None},
        "queue": "reports",
        "priority": 7,
        "owner_id": admin_user.pk,
        "state": JobState.QUEUED,
        "max_attempts": 3,
        "enqueued_at": now,
        "trace_context": {"traceparent": "00-ab-cd-01"},
    }
    built = Job(id=uuid.uuid4(), **values)

    # when new_job builds it, twice
    fast, other = ledger.new_job(id=uuid.uuid4(), **values), ledger.new_job(id=uuid.uuid4())

    # then every column holds what Job(...) set, defaults included; a callable default is
    # called for each row (no list shared between two rows); inserted, it reads back the same
    assert the_columns(fast) == the_columns(built)
    assert fast._state.adding and fast._state.db is None
    assert other.failures == [] and other.failures is not fast.failures
    ledger.insert(fast)
    assert the_columns(Job.objects.get(id=fast.id)) == the_columns(built)


def test_new_job_is_job_init_when_a_project_listens_to_its_init() -> None:
    from django.db.models.signals import post_init

    seen: list[Any] = []

    def listen(sender: Any, instance: Job, **kwargs: Any) -> None:
        seen.append(instance)

    post_init.connect(listen, sender=Job)
    try:
        job = ledger.new_job(id=uuid.uuid4(), task_name="tests.add")
    finally:
        post_init.disconnect(listen, sender=Job)
    assert seen == [job]
