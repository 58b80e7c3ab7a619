"""CELERY_TASK_ROUTES (Celery's task_routes) decides a job's queue when neither the call nor the
task's declaration names one (jobs.enqueue.routing): the ledger row records it and a real
worker on that queue runs it from there."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import transaction

from config.celery import app
from jobs.enqueue.fanout import enqueue_many
from jobs.models import Job, JobState
from jobs.testing import Worker as PlatformWorker
from tests.conftest import LOG_DIR, ROOT, wait_until
from tests.support import routing_tasks, tasks

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def routes() -> Iterator[Callable[[Any], None]]:
    """Sets the caller's CELERY_TASK_ROUTES (this process enqueues), as a project's settings do."""
    original = app.conf.task_routes

    def set_routes(value: Any) -> None:
        app.conf.task_routes = value
        app.amqp.flush_routes()
        app.amqp.__dict__.pop("router", None)  # Celery's cached Router, built from the routes

    yield set_routes
    set_routes(original)


@pytest.fixture
def reports_worker(worker_env, clean_redis) -> Iterator[PlatformWorker]:
    """A real worker on `reports` only (the session worker leaves it alone)."""
    worker = PlatformWorker(
        "config",
        queues="reports",
        concurrency=1,
        name="routed",
        env=worker_env,
        cwd=ROOT,
        log_dir=LOG_DIR,
        extra_args=["-I", "tests.support.tasks,tests.support.routing_tasks",
                    "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO"],
    )  # fmt: skip
    yield worker
    worker.stop()


class RolledBack(Exception):
    pass


def queue_chosen(send: Callable[[], Any]) -> str:
    """The queue the ledger row of `send()` records, rolled back: nothing is published."""
    chosen = ""
    with contextlib.suppress(RolledBack), transaction.atomic():
        chosen = Job.objects.get(id=send().id).queue
        raise RolledBack
    return chosen


def finished(job_id: str) -> Job | None:
    row = Job.objects.filter(id=job_id).first()
    return row if row is not None and row.finished_at is not None else None


def test_a_routed_job_and_an_adopted_task_run_from_the_routed_queue(routes, reports_worker):
    # given: the project routes them to `reports` (a glob, as Celery's docs write routes)
    routes({"tests.routing.*": {"queue": "reports"}})

    # when: sent as Celery code sends them
    sent = [routing_tasks.where.delay("a"), routing_tasks.adopted.apply_async(("b",))]

    # then: each row says `reports`, and the worker on `reports` took them from there
    rows = [wait_until(functools.partial(finished, r.id), timeout=60) for r in sent]
    assert [(r.queue, r.state, r.result) for r in rows] == [
        ("reports", JobState.SUCCEEDED, "reports")
    ] * 2


def test_the_call_and_the_declaration_win_over_a_route(routes, clean_redis):
    # given: every task routed to `reports`, in each form Celery takes
    for table in (
        {"tests.*": "reports"},
        [{"tests.routing.where": {"queue": "reports"}}, {"tests.*": "reports"}],
        lambda name, args, kwargs, options, task=None, **kw: {"queue": "reports"},
    ):
        routes(table)

        # a job that declares no queue, by each enqueue path: routed
        assert queue_chosen(lambda: routing_tasks.where.delay("k")) == "reports"
        assert queue_chosen(lambda: routing_tasks.where.enqueue("k")) == "reports"
        assert queue_chosen(lambda: tasks.record.using(priority=3).enqueue("k")) == "reports"
        # ... and a fan-out
        with contextlib.suppress(RolledBack), transaction.atomic():
            ids = enqueue_many(tasks.record, [(("k",), {}), (("l",), {})])
            assert set(Job.objects.filter(id__in=ids).values_list("queue", flat=True)) == {
                "reports"
            }
            raise RolledBack
        # the call's queue= wins (Celery: apply_async's options over the route)
        assert (
            queue_chosen(lambda: routing_tasks.where.apply_async(("k",), queue="media")) == "media"
        )
        assert (
            queue_chosen(lambda: routing_tasks.where.using(queue="media").enqueue("k")) == "media"
        )
        # a declared queue wins (Celery: the task's queue attribute over the route)
        assert queue_chosen(lambda: routing_tasks.declared.delay("k")) == "emails"


def test_without_a_matching_route_the_default_queue_stays(routes, clean_redis):
    routes({"elsewhere.*": "reports"})

    assert queue_chosen(lambda: routing_tasks.where.delay("k")) == "default"
    assert queue_chosen(lambda: routing_tasks.adopted.delay("k")) == "default"


def test_a_route_to_an_unknown_queue_is_refused_at_the_call(routes, clean_redis):
    routes({"tests.routing.*": "nowhere"})

    with pytest.raises(ValueError, match="Unknown queue 'nowhere'"):
        routing_tasks.where.delay("k")
    assert not Job.objects.filter(task_name="tests.routing.where").exists()
