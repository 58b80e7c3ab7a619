"""Looks up registered platform tasks by name (for replay and the relay)."""

from __future__ import annotations

from celery import current_app

from .exceptions import UnknownTask
from .task import PlatformTask


def task_by_name(name: str) -> PlatformTask:
    task = current_app.tasks.get(name)
    if task is None or not isinstance(task, PlatformTask):
        raise UnknownTask(
            f"No job named {name!r} is registered (was it renamed or removed?); nothing was sent"
        )
    return task


def platform_tasks() -> list[PlatformTask]:
    return [task for task in current_app.tasks.values() if isinstance(task, PlatformTask)]
