"""Jobs made of durable steps (jobs.worker.steps), for tests/jobs/worker/test_steps.py; real
worker processes import this module (-I). Each step counts its runs in Redis (mark)."""

from __future__ import annotations

import time
from typing import Any

from jobs import RetryPolicy, StepTimeout, job
from tests.support.tasks import mark, wait_for_flag

QUICK_RETRIES = RetryPolicy(max_attempts=4, base_delay=0.2, factor=1.0, jitter=False)


def first(key: str) -> dict[str, Any]:
    mark(f"{key}:one")
    return {"rows": [1, 2, 3]}


def second(key: str, rows: list[int], stall: float) -> int:
    if mark(f"{key}:two") == 1 and stall:
        time.sleep(stall)  # the first run stalls here: the test kills its worker
    return sum(rows)


def third(key: str, total: int, fail_times: int) -> str:
    if mark(f"{key}:three") <= fail_times:
        raise ConnectionError("the third step's service is away")
    return f"total {total}"


def three_steps(task: Any, key: str, fail_times: int, stall: float) -> list[Any]:
    fetched = task.step("fetch", first, key)
    total = task.step("sum", second, key, fetched["rows"], stall)
    return [fetched, total, task.step("post", third, key, total, fail_times)]


@job(name="steps.three", bind=True, queue="reports", retry=QUICK_RETRIES)
def three(self: Any, key: str, fail_times: int = 0, stall: float = 0) -> list[Any]:
    return three_steps(self, key, fail_times, stall)


@job(
    name="steps.three_dies",
    bind=True,
    queue="reports",
    retry=RetryPolicy(max_attempts=2, base_delay=0.2, jitter=False),
)
def three_dies(self: Any, key: str, fail_times: int = 0) -> list[Any]:
    return three_steps(self, key, fail_times, 0)


@job(name="steps.reordered", bind=True, queue="reports", retry=QUICK_RETRIES)
def reordered(self: Any, key: str) -> None:
    """Its first run asks for a then b and fails; its retry (new code) asks for b first."""
    names = ["a", "b"] if self.request.retries == 0 else ["b", "a"]
    for name in names:
        self.step(name, mark, f"{key}:{name}")
    if self.request.retries == 0:
        raise ConnectionError("first run fails after its steps")


@job(name="steps.decorated", bind=True, queue="reports", retry=QUICK_RETRIES)
def decorated(self: Any, key: str) -> int:
    """The decorator form: each call of a decorated function is a step."""

    @self.step("count")
    def counted(label: str) -> int:
        return mark(f"{key}:{label}")

    runs = counted("count")
    if mark(f"{key}:job") == 1:
        raise ConnectionError("fails once after its step")
    return int(runs)


@job(name="steps.too_large", bind=True, queue="reports", retry=QUICK_RETRIES)
def too_large(self: Any, size: int) -> None:
    self.step("big", lambda: "x" * size)


@job(name="steps.napper", bind=True, queue="reports", retry=QUICK_RETRIES)
def napper(self: Any, key: str, seconds: float) -> str:
    self.step("before", mark, f"{key}:before")
    self.sleep(seconds)
    self.step("after", mark, f"{key}:after")
    return "rested"


@job(name="steps.quick", queue="reports")
def quick(key: str) -> None:
    mark(key)


@job(name="steps.waiter", bind=True, queue="reports", retry=QUICK_RETRIES)
def waiter(self: Any, key: str, timeout: float | None = None) -> Any:
    """Waits for the signal "approved" between two steps; returns its payload."""
    self.step("before", mark, f"{key}:before")
    try:
        payload = self.wait_for("approved", timeout=timeout)
    except StepTimeout:
        payload = "timed out"
    self.step("after", mark, f"{key}:after")
    return payload


@job(name="steps.nested", bind=True, queue="reports", retry=QUICK_RETRIES)
def nested(self: Any, key: str) -> None:
    """Asks for a step inside another step's function."""
    self.step("outer", lambda: self.step("inner", mark, f"{key}:inner"))


def held_once(key: str, rows: list[int]) -> int:
    """The first run waits in here for the test's flag (the test stops its worker meanwhile)."""
    if mark(f"{key}:two") == 1:
        wait_for_flag(f"{key}:resume", timeout=90)
    return sum(rows)


@job(name="steps.held", bind=True, queue="reports", retry=QUICK_RETRIES)
def held(self: Any, key: str) -> list[Any]:
    """Three steps whose second holds its first run until the test lets it go."""
    fetched = self.step("fetch", first, key)
    total = self.step("sum", held_once, key, fetched["rows"])
    return [fetched, total, self.step("post", third, key, total, 0)]
