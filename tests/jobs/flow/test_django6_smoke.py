"""The platform on whichever Django runs the tests: enqueue, worker, dead letter, replay.

scripts/test.sh runs this module (with tests/jobs/flow/test_tasks_backend.py) a second time from
.venv-django6, so the same assertions hold on Django 5.2 with the django-tasks backport and on
Django 6 with the built-in django.tasks; the worker is started from the same virtualenv.
"""

from __future__ import annotations

import sys
from importlib import import_module
from typing import Any

import django
import pytest
from django.conf import settings
from django.core import checks

from jobs import dead_letter_replay
from jobs.flow.backends import CeleryBackend
from jobs.models import DeadLetter, DeadLetterStatus, Job, JobState
from tests.conftest import marks, set_flag, wait_until
from tests.support import std_tasks, tasks
from tests.support.tasks_api import (
    TaskResult,
    TaskResultStatus,
    default_task_backend,
    task,
    task_backends,
)

ON_DJANGO_6 = django.VERSION >= (6, 0)
TASKS_MODULE = "django.tasks" if ON_DJANGO_6 else "django_tasks"


@task()
def worker_runtime() -> dict[str, Any]:
    """What the worker that ran it runs on (imported by the worker by its module path)."""
    return {"django": django.get_version(), "prefix": sys.prefix}


def finished(job_id: str, timeout: float = 30) -> Job:
    return wait_until(
        lambda: Job.objects.filter(
            id=job_id, state__in=[JobState.SUCCEEDED, JobState.DEAD]
        ).first(),
        timeout=timeout,
        what=f"job {job_id} to finish",
    )


def settled(result: TaskResult, timeout: float = 30) -> TaskResult:
    def done() -> bool:
        result.refresh()
        return result.is_finished

    wait_until(done, timeout=timeout, what=f"task {result.id} to finish")
    return result


def test_the_tasks_api_is_the_one_this_django_ships():
    backend_base = import_module(f"{TASKS_MODULE}.backends.base").BaseTaskBackend
    task_class = import_module(f"{TASKS_MODULE}.base").Task

    assert isinstance(task_backends["default"], CeleryBackend)
    assert issubclass(CeleryBackend, backend_base)
    assert isinstance(std_tasks.add, task_class)
    # Django 6 needs no app for it; the backport's app brings its system checks on 5.2.
    assert ("django_tasks" in settings.INSTALLED_APPS) is not ON_DJANGO_6


def test_a_bad_tasks_queue_fails_the_system_check(settings):
    settings.TASKS = {
        "default": {"BACKEND": "jobs.flow.backends.CeleryBackend", "QUEUES": ["bulk"]}
    }

    problems = checks.run_checks()

    assert "jobs.tasks.E001" in [problem.id for problem in problems]


def test_a_job_and_a_standard_task_run_on_a_worker_of_this_django(worker):
    handle = tasks.add.enqueue(2, 40)
    result = std_tasks.add.enqueue(20, 22)
    runtime = worker_runtime.enqueue()

    assert finished(handle.id).result == 42
    assert settled(result).status == TaskResultStatus.SUCCESSFUL and result.return_value == 42
    assert settled(runtime).return_value == {"django": django.get_version(), "prefix": sys.prefix}


def test_a_job_that_dead_letters_is_replayed_to_success(worker, unique):
    handle = tasks.explicit.enqueue(unique, 4)  # TimeoutError on runs 1-4: its 4 attempts

    dead_job = finished(handle.id)

    assert dead_job.state == JobState.DEAD and dead_job.attempts == 4
    dead = DeadLetter.objects.get(job_id_value=handle.id)
    assert dead.exception_class == "TimeoutError"

    replay = dead_letter_replay(dead_letter=dead)

    replayed = finished(replay.id)
    assert replayed.state == JobState.SUCCEEDED and replayed.result == "done"
    assert replayed.replay_of_id == dead.pk
    dead.refresh_from_db()
    assert dead.status == DeadLetterStatus.REPLAYED
    assert len(marks(unique)) == 5


def test_a_standard_task_that_dead_letters_is_replayed_to_success(worker, unique):
    failed = settled(std_tasks.needs_flag.enqueue(unique))  # ValueError: not retried
    assert failed.status == TaskResultStatus.FAILED
    assert [error.exception_class for error in failed.errors] == [ValueError]
    set_flag(unique)

    replay = dead_letter_replay(dead_letter=DeadLetter.objects.get(job_id_value=failed.id))

    replayed = settled(default_task_backend.get_result(replay.id))
    assert replayed.status == TaskResultStatus.SUCCESSFUL
    assert replayed.return_value == "replayed"


@pytest.mark.skipif(not ON_DJANGO_6, reason="the backport is the only Tasks API on Django 5.2")
def test_on_django_6_the_backport_is_not_imported():
    assert "django_tasks" not in sys.modules
