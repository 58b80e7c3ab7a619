"""Celery's t/integration/tasks.py with its tasks declared through @job or Celery's shared_task.

The run tree's t/integration/tasks.py (written by tests.celery_compat.run) is two lines that
call ``declare_celery_tasks(globals(), <Celery's original tasks.py>)``: Celery's source is
executed in that module, so every task keeps the name Celery gives it
(``t.integration.tasks.add``, which some tests spell out), and the one name ``shared_task``
is bound to the decorator CELERY_COMPAT_DECORATOR picks:

- ``job`` (the default): ``jobs.job``, what a team moving its Celery tasks onto Backlot writes;
  Celery's task options (``bind=True``, ``max_retries=1``, ``ignore_result=True``...) are
  passed to it as they are (@job hands what it does not know to Celery);
- ``shared_task``: Celery's own, the control.

Nothing else in Celery's file changes. A declaration that @job refuses when the module is
imported (it validates some options up front) leaves a stand-in that raises that same error
whenever a test uses the task, so the rest of the module still loads and only the tests of
that task fail. The worker imports the same module (``-I t.integration.tasks``).
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

DECORATORS = ("job", "shared_task")
# Class-based tasks that Celery's conftest registers with its session worker (its
# celery_class_tasks fixture); our worker process (CELERY_COMPAT_WORKER=1) registers them at
# import. The tests register their own instance in the test process.
CLASS_TASKS = ("ClassBasedAutoRetryTask",)
# Declarations @job refused, by function name: the error, as "Type: message".
REFUSED: dict[str, str] = {}


def decorator_name() -> str:
    name = os.environ.get("CELERY_COMPAT_DECORATOR", "job")
    if name not in DECORATORS:
        raise RuntimeError(
            f"CELERY_COMPAT_DECORATOR must be one of {', '.join(DECORATORS)}; got {name!r}"
        )
    return name


class RefusedDeclaration:
    """Stands for a task whose @job declaration raised: any use raises that error again."""

    def __init__(self, fn: Callable[..., Any], error: BaseException) -> None:
        self.__name__ = fn.__name__
        self.__qualname__ = fn.__qualname__
        self.__doc__ = fn.__doc__
        self._error = error

    def _raise(self) -> Any:
        error = self._error
        raise type(error)(*error.args) from error

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return self._raise()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._raise()

    def __repr__(self) -> str:
        return f"<@job refused {self.__name__}: {self._error!r}>"


def _declare_with_job(fn: Callable[..., Any], options: dict[str, Any]) -> Any:
    from jobs import job

    try:
        return job(**options)(fn)
    except Exception as exc:  # noqa: BLE001 - reported, and raised again where the task is used
        REFUSED[fn.__name__] = f"{type(exc).__name__}: {exc}"
        print(
            f"celery-compat: @job refused {fn.__module__}.{fn.__name__}({options}): "
            f"{type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return RefusedDeclaration(fn, exc)


def job_as_shared_task(*args: Any, **options: Any) -> Any:
    """``@shared_task``, ``@shared_task(...)`` and ``shared_task(fn, ...)`` spelled with @job."""
    if args:
        if len(args) != 1 or not callable(args[0]):
            raise TypeError(f"shared_task takes one function positionally, got {args!r}")
        return _declare_with_job(args[0], options)
    return lambda fn: _declare_with_job(fn, options)


def _without_shared_task_import(tree: ast.Module, filename: str) -> ast.Module:
    found = False
    for index, node in enumerate(tree.body):
        if isinstance(node, ast.ImportFrom) and node.module == "celery":
            kept = [alias for alias in node.names if alias.name != "shared_task"]
            if len(kept) != len(node.names):
                found = True
                node.names = kept
                if not kept:
                    tree.body[index] = ast.copy_location(ast.Pass(), node)
    if not found:
        raise RuntimeError(
            f"{filename} no longer has `from celery import shared_task`: the harness "
            "(tests/celery_compat/tasks.py) must learn how this Celery version declares its tasks"
        )
    return tree


def declare_celery_tasks(namespace: dict[str, Any], celery_tasks_py: str | Path) -> None:
    """Execute Celery's tasks.py in ``namespace`` with ``shared_task`` switched."""
    from celery import shared_task

    from config.celery import app

    path = Path(celery_tasks_py)
    source = path.read_text(encoding="utf-8")
    tree = _without_shared_task_import(ast.parse(source, str(path)), str(path))
    namespace["shared_task"] = job_as_shared_task if decorator_name() == "job" else shared_task
    namespace["CELERY_COMPAT_DECORATOR"] = decorator_name()
    namespace["CELERY_COMPAT_REFUSED"] = REFUSED
    exec(compile(tree, str(path), "exec"), namespace)  # Celery's own test tasks
    if os.environ.get("CELERY_COMPAT_WORKER") == "1":
        for name in CLASS_TASKS:
            cls = namespace.get(name)
            if cls is not None:
                app.register_task(cls())
