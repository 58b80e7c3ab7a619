"""Django's Tasks API as an app on both Djangos imports it: django.tasks on 6, the backport on 5.2.

The tests and tests/support/std_tasks.py import it from here, so the same tests run on the
default Django 5.2 and in .venv-django6 (scripts/test.sh) against the built-in module.
"""

from typing import TYPE_CHECKING

import django

# mypy reads the backport's branch: it is typed, and Django 5.2's stubs have no django.tasks.
if TYPE_CHECKING or django.VERSION < (6, 0):
    from django_tasks import (
        TaskContext,
        TaskResult,
        TaskResultStatus,
        default_task_backend,
        task,
        task_backends,
    )
    from django_tasks.exceptions import InvalidTaskError as InvalidTask
    from django_tasks.exceptions import TaskResultDoesNotExist, TaskResultMismatch
    from django_tasks.signals import task_enqueued
else:
    from django.tasks import (
        TaskContext,
        TaskResult,
        TaskResultStatus,
        default_task_backend,
        task,
        task_backends,
    )
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist, TaskResultMismatch
    from django.tasks.signals import task_enqueued

__all__ = [
    "InvalidTask",
    "TaskContext",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultMismatch",
    "TaskResultStatus",
    "default_task_backend",
    "task",
    "task_backends",
    "task_enqueued",
]
