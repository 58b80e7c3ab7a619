"""Celery-style tasks declared with @job, the way a team moving Celery code onto Backlot
writes them (after Celery's t/integration/tasks.py); real workers import this module (-I)."""

from __future__ import annotations

import time
from typing import Any

from celery import Task
from celery.canvas import StampingVisitor  # type: ignore[attr-defined]  # not in celery-types
from celery.exceptions import Reject
from pydantic import BaseModel

from jobs.broker.redis import redis_client
from jobs.worker.decorators import job


class ExpectedException(Exception):
    """Raised on purpose; equal to another with the same class and arguments (as Celery's)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExpectedException) and self.args == other.args

    def __hash__(self) -> int:
        return hash(self.args)


def echo(key: str, value: Any) -> None:
    redis_client().rpush(f"test:{key}", str(value))


def echoed(key: str) -> list[str]:
    values = redis_client().lrange(f"test:{key}", 0, -1)
    return [v.decode() if isinstance(v, bytes) else v for v in values]


@job(name="compat.add")
def add(x: int, y: int) -> int:
    return x + y


@job(name="compat.sleeping")
def sleeping(seconds: float) -> None:
    time.sleep(seconds)


@job(name="compat.sleeping_tracked", track_started=True)
def sleeping_tracked(seconds: float) -> None:
    time.sleep(seconds)


@job(name="compat.fail")
def fail(*args: Any) -> None:
    raise ExpectedException("Task expected to fail", *args)


@job(name="compat.retry", bind=True, default_retry_delay=0.2)
def retry(self: Any, key: str, succeed_after: int | None = None) -> Any:
    """self.retry(exc=ExpectedException()) until `succeed_after` retries (never: gives up)."""
    echo(key, self.request.retries)
    if succeed_after is not None and self.request.retries >= succeed_after:
        return f"retried {self.request.retries}"
    raise self.retry(exc=ExpectedException("flaky", self.request.retries), max_retries=2)


@job(name="compat.retry_transient", bind=True, max_retries=1)
def retry_transient(self: Any, key: str) -> None:
    """Retries once with an exception the policy would retry on its own: past max_retries the
    job must give up with it all the same."""
    echo(key, self.request.retries)
    raise self.retry(exc=ConnectionError("down", self.request.retries), countdown=0.1)


@job(name="compat.retry_no_exc", bind=True, max_retries=1)
def retry_no_exc(self: Any) -> None:
    raise self.retry(countdown=0.1)


@job(name="compat.retry_once_options", bind=True, max_retries=1)
def retry_once_options(self: Any, foo: int, **options: Any) -> dict[str, Any]:
    """Retries once, with new arguments and options; returns what the retried run saw."""
    if self.request.retries:
        return {
            "foo": foo,
            "retries": self.request.retries,
            "priority": self.request.delivery_info.get("priority"),
            "queue": self.request.delivery_info.get("routing_key"),
            "headers": self.request.headers,
            "time_limit": self.request.timelimit,
        }
    raise self.retry(args=(foo + 1,), countdown=0.1, **options)


@job(name="compat.retry_eta", bind=True, max_retries=1)
def retry_eta(self: Any, seconds: float) -> float:
    from datetime import timedelta

    from django.utils import timezone

    if self.request.retries:
        return time.time()
    raise self.retry(eta=timezone.now() + timedelta(seconds=seconds))


@job(name="compat.reject_without_requeue")
def reject_without_requeue() -> None:
    raise Reject("rejected", requeue=False)


@job(name="compat.ids", bind=True)
def ids(self: Any, i: int) -> tuple[Any, Any, int]:
    return self.request.root_id, self.request.parent_id, i


@job(name="compat.collect_ids", bind=True)
def collect_ids(self: Any, res: Any, i: int) -> tuple[Any, tuple[Any, Any, int]]:
    return res, (self.request.root_id, self.request.parent_id, i)


@job(name="compat.build_chain_inside_task", bind=True)
def build_chain_inside_task(self: Any) -> Any:
    from celery import group

    # celery-types types `signature | group` as a dict; it is a chain
    built: Any = add.s(1, 1) | add.s(2) | group(add.s(3), add.s(4)) | add.s(5)
    return built()


@job(name="compat.return_exception")
def return_exception(e: Any) -> tuple[Any, bool]:
    return e, True


@job(name="compat.errback_new_style")
def errback_new_style(request: Any, exc: BaseException, traceback: Any) -> None:
    echo(request.id, f"{type(exc).__name__}{exc.args!r}")


@job(name="compat.errback_old_style")
def errback_old_style(task_id: str) -> str:
    echo(task_id, "old-style")
    return task_id


@job(name="compat.identity")
def identity(x: Any) -> Any:
    return x


@job(name="compat.tsum")
def tsum(nums: list[int]) -> int:
    return sum(nums)


@job(name="compat.redis_echo")
def redis_echo(message: Any, key: str) -> None:
    """Append `message` to the test list `key` (a callback or an immutable errback)."""
    echo(key, message)


@job(name="compat.retry_once", bind=True, max_retries=1)
def retry_once(self: Any, *args: Any, countdown: float | None = 0.1) -> int:
    """An errback that retries once: returns the number of retries."""
    if self.request.retries:
        return int(self.request.retries)
    raise self.retry(countdown=countdown)


@job(name="compat.retry_with_args_after_kwargs", bind=True, max_retries=1)
def retry_with_args_after_kwargs(
    self: Any, foo: int, bar: int, label: str | None = None
) -> dict[str, Any]:
    if not self.request.retries:
        raise self.retry(args=(foo + 1, bar + 1), countdown=0)
    return {"foo": foo, "bar": bar, "label": label, "retries": self.request.retries}


@job(name="compat.retry_with_kwargs_after_args", bind=True, max_retries=1)
def retry_with_kwargs_after_args(self: Any, foo: int, bar: int) -> dict[str, Any]:
    if not self.request.retries:
        raise self.retry(kwargs={"foo": foo + 1}, countdown=0)
    return {"foo": foo, "bar": bar, "retries": self.request.retries}


@job(name="compat.add_replaced", bind=True)
def add_replaced(self: Any, x: int, y: int) -> None:
    raise self.replace(add.s(x, y))


@job(name="compat.add_replaced_with_chain", bind=True)
def add_replaced_with_chain(self: Any, x: int, y: int) -> None:
    from celery import chain

    raise self.replace(chain(add.s(x, y), identity.s()))


@job(name="compat.add_to_all", bind=True)
def add_to_all(self: Any, nums: list[int], val: int) -> None:
    from celery import group

    raise self.replace(group(*(add.s(num, val) for num in nums)))


@job(name="compat.fail_replaced", bind=True)
def fail_replaced(self: Any, *args: Any) -> None:
    raise self.replace(fail.si(*args))


@job(name="compat.replace_with_slow", bind=True)
def replace_with_slow(self: Any, seconds: float) -> None:
    raise self.replace(sleeping.si(seconds) | add.si(1, 1))


@job(name="compat.request_headers", bind=True)
def request_headers(self: Any) -> dict[str, Any]:
    """What the task's request says of its message's headers and stamps."""
    request = self.request
    stamps = {
        name: getattr(request, "stamps", {}).get(name) for name in request.stamped_headers or []
    }
    return {"headers": request.headers or {}, "stamps": stamps}


@job(name="compat.request_reprs", bind=True)
def request_reprs(self: Any, *_args: Any, **_kwargs: Any) -> list[Any]:
    """The readable copies of its arguments that the task's message carried."""
    return [self.request.argsrepr, self.request.kwargsrepr]


@job(name="compat.limits_once", bind=True)
def limits_once(self: Any, key: str) -> dict[str, Any]:
    """Fails its first run (no retry); a run after that returns what its message said."""
    echo(key, "run")
    if len(echoed(key)) == 1:
        raise ExpectedException("first run fails")
    return {
        "time_limit": self.request.timelimit,
        "priority": self.request.delivery_info.get("priority"),
        "queue": self.request.delivery_info.get("routing_key"),
        "headers": self.request.headers or {},
    }


@job(name="compat.return_priority", bind=True)
def return_priority(self: Any, *_args: Any) -> str:
    return f"Priority: {self.request.delivery_info['priority']}"


class Point(BaseModel):
    x: int
    y: int


class Total(BaseModel):
    total: int


@job(name="compat.add_points", pydantic=True)
def add_points(data: Point) -> Total:
    """Celery's pydantic=True: the caller passes a model, the task gets one back."""
    return Total(total=data.x + data.y)


class _ReplacedStamp(StampingVisitor):
    def on_signature(self, sig: Any, **headers: Any) -> dict[str, Any]:
        return {"replaced_by": "audited"}


class AuditedTask(Task):
    """A Celery base class of the kind teams share between their tasks: a helper of its own and
    a hook (on_replace stamps the replacing signature, as Celery's test suite's does)."""

    def audit(self, key: str, what: str) -> None:
        echo(key, f"{self.name}: {what}")

    def on_replace(self, sig: Any) -> Any:
        sig.stamp(_ReplacedStamp())
        return super().on_replace(sig)


@job(name="compat.audited_replace", bind=True, base=AuditedTask)
def audited_replace(self: Any, key: str) -> None:
    self.audit(key, "replaced")
    raise self.replace(request_headers.si())
