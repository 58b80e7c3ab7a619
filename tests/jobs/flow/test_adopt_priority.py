"""An adopted task's priorities are read on Celery's Redis scale (0 first, 9 last) and become
Backlot's (9 first) as 9 - level: the call's, the task's own, CELERY_TASK_DEFAULT_PRIORITY,
kombu's default level 0 (jobs.flow.adopt); a real worker runs them in that order."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
from django.db import transaction

from jobs.broker.redis import redis_client
from jobs.flow.adopt import AdoptedTask, backlot_priority
from jobs.models import Job
from jobs.testing import Worker as PlatformWorker
from tests.conftest import LOG_DIR, ROOT, wait_until
from tests.support import priority_tasks as t

pytestmark = pytest.mark.django_db(transaction=True)


class RolledBack(Exception):
    pass


def priority_of(send: Callable[[], Any]) -> int:
    """The Backlot priority the ledger row of `send()` records, rolled back (nothing sent)."""
    chosen = -1
    with contextlib.suppress(RolledBack), transaction.atomic():
        chosen = Job.objects.get(id=send().id).priority
        raise RolledBack
    return chosen


def marks(key: str) -> list[str]:
    values = redis_client().lrange(f"test:priority:{key}", 0, -1)
    return [v.decode() if isinstance(v, bytes) else v for v in values]


def reports_worker(worker_env: dict[str, str]) -> PlatformWorker:
    return PlatformWorker(
        "config",
        queues="reports",
        concurrency=1,
        name="priority",
        env=worker_env,
        cwd=ROOT,
        log_dir=LOG_DIR,
        extra_args=["-I", "tests.support.priority_tasks", "--without-gossip",
                    "--without-mingle", "--without-heartbeat", "-l", "INFO"],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("level", "backlot"), [(0, 9), (1, 8), (4, 5), (5, 4), (9, 0), (255, 0), (-3, 9)]
)
def test_a_celery_redis_level_is_backlots_nine_minus_it(level, backlot):
    assert backlot_priority(level) == backlot


def test_each_way_celery_code_gives_a_priority_reaches_the_row(clean_redis):
    # the task's own priority=, and kombu's default level 0 for a task without one
    assert priority_of(lambda: t.urgent.delay("k", "u")) == 9
    assert priority_of(lambda: t.background.delay("k", "b")) == 1
    assert priority_of(lambda: t.plain.delay("k", "p")) == 9
    # the call's, over the task's: apply_async, a signature's set(), its options
    assert priority_of(lambda: t.urgent.apply_async(("k", "u"), priority=7)) == 2
    assert priority_of(lambda: t.plain.s("k", "p").set(priority=3).delay()) == 6
    assert priority_of(lambda: t.plain.signature(("k", "p"), priority=6).apply_async()) == 3
    # AMQP's 0-255 clamps to kombu's last level, as Celery on Redis does
    assert priority_of(lambda: t.plain.apply_async(("k", "p"), priority=200)) == 0


def test_celerys_default_priority_applies_to_a_task_without_its_own():
    class Conf:
        task_default_priority = 4

    class App:
        conf = Conf()

    # how Celery builds a task's class from @shared_task's options (adopt mode's base)
    declared: type[AdoptedTask] = type(
        "t", (AdoptedTask,), {"app": App(), "name": "tests.priority.x"}
    )
    own: type[AdoptedTask] = type(
        "t", (AdoptedTask,), {"app": App(), "name": "tests.priority.y", "priority": 2}
    )

    assert (declared.default_priority, own.default_priority) == (5, 7)


def test_a_real_worker_runs_adopted_tasks_in_celerys_priority_order(worker_env, clean_redis):
    # given: sent while no worker consumes `reports`, the least urgent first
    t.background.delay("order", "background")  # level 8
    t.plain.apply_async(("order", "plain-5"), priority=5)  # level 5
    t.urgent.delay("order", "urgent")  # level 0
    t.retried.apply_async(("retry",), priority=8)

    # when
    worker = reports_worker(worker_env)
    try:
        wait_until(lambda: len(marks("order")) == 3, timeout=60, what="three runs")
        wait_until(lambda: len(marks("retry")) == 2, timeout=60, what="the retried run")
    finally:
        worker.stop()

    # then: Celery's order on Redis, level 0 first
    assert marks("order") == ["urgent", "plain-5", "background"]
    # self.retry(priority=1) is Celery's level 1 too: Backlot's 8 on the next run
    assert marks("retry") == ["1", "8"]
