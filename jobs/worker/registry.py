"""Looks up registered platform tasks by name (for replay, the relay and system checks).

Celery imports the task modules of installed apps (autodiscover) only when a worker starts; a
web process, the relay or a management command has imported only what its own code did. A
name not registered yet makes Celery import them, as a worker would, before the lookup gives
up: the relay process publishes jobs of every app without a worker's help.
"""

from __future__ import annotations

from celery import current_app

from jobs.core.exceptions import UnknownTask
from jobs.worker.task import PlatformTask


def _import_task_modules() -> None:
    """Import what a worker imports at start: the installed apps' tasks modules and the
    modules of CELERY_IMPORTS / CELERY_INCLUDE (a worker's own `-I` modules excepted)."""
    # force=True imports the installed apps' tasks modules now, without the import_modules
    # signal (whose Django fixup would run the system checks, which call platform_tasks()).
    current_app.autodiscover_tasks(force=True)
    for module in current_app.loader.default_modules:
        current_app.loader.import_task_module(module)


def task_by_name(name: str) -> PlatformTask:
    task = current_app.tasks.get(name)
    if task is None:
        _import_task_modules()
        task = current_app.tasks.get(name)
    if task is None or not isinstance(task, PlatformTask) or not getattr(task, "adopted", True):
        raise UnknownTask(
            f"No job named {name!r} is registered (was it renamed or removed?); nothing was sent"
        )
    return task


def platform_tasks() -> list[PlatformTask]:
    _import_task_modules()
    return [
        task
        for task in current_app.tasks.values()
        if isinstance(task, PlatformTask) and getattr(task, "adopted", True)  # not opted out
    ]
