"""Jobs used by the test suite; real worker processes import this module (-I)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import Any

from billiard.exceptions import SoftTimeLimitExceeded

from jobs import JobCancelled
from jobs.broker.redis import redis_client
from jobs.core.policies import Permanent, RetryPolicy
from jobs.worker.decorators import job
from jobs.worker.effects import effect_once


def mark(key: str, value: Any = None) -> int:
    """Append a timestamped entry to a Redis list the test reads; returns the new length."""
    return int(
        redis_client().rpush(f"test:{key}", f"{time.time()}|{'' if value is None else value}")
    )


def wait_for_flag(key: str, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if redis_client().exists(f"test:flag:{key}"):
            return True
        time.sleep(0.02)
    return False


@job(name="tests.add")
def add(a: int, b: int) -> int:
    return a + b


@job(name="tests.record")
def record(key: str, label: str = "") -> str:
    mark(key, label)
    return label


@job(name="tests.record_untracked", track=False)
def record_untracked(key: str) -> None:
    mark(key)


@job(
    name="tests.flaky", retry=RetryPolicy(max_attempts=4, base_delay=1.0, factor=2.0, jitter=False)
)
def flaky(key: str, fail_times: int) -> str:
    runs = mark(key)
    if runs <= fail_times:
        raise ConnectionError(f"flaky failure {runs}")
    return "done"


@job(name="tests.explicit", retry=RetryPolicy.explicit(0.5, 2.0, 1.0))
def explicit(key: str, fail_times: int) -> str:
    runs = mark(key)
    if runs <= fail_times:
        raise TimeoutError(f"timeout {runs}")
    return "done"


@job(name="tests.refused", retry=RetryPolicy(max_attempts=5, base_delay=0.1))
def refused(key: str, to: str) -> None:
    mark(key)
    raise Permanent(f"550 recipient refused: {to}")


@job(name="tests.rate_limited", rate_limit="20/s")
def rate_limited(key: str) -> None:
    mark(key)


@job(name="tests.slow_once")
def slow_once(key: str, seconds: float) -> None:
    mark(key)
    time.sleep(seconds)


@job(name="tests.progress", bind=True)
def progress(self: Any, key: str, steps: int) -> int:
    for step in range(1, steps + 1):
        self.progress(step, steps, f"step {step}")
        if step == steps // 2:
            wait_for_flag(key)
    return steps


@job(name="tests.effect_then_fail", retry=RetryPolicy(max_attempts=3, base_delay=0.2, jitter=False))
def effect_then_fail(key: str) -> str:
    with effect_once(f"test-effect:{key}") as effect:
        if not effect.done:
            mark(f"{key}:applied")
    if mark(f"{key}:runs") == 1:
        raise ConnectionError("lost the connection after the effect committed")
    return "ok"


@job(
    name="tests.time_limited",
    soft_time_limit=1,
    time_limit=3,
    retry=RetryPolicy(max_attempts=2, base_delay=0.2, jitter=False),
)
def time_limited(key: str) -> None:
    mark(key)
    time.sleep(10)


@job(name="tests.prioritized", queue="reports")
def prioritized(key: str, label: str) -> None:
    mark(key, label)


@job(
    name="tests.hard_limited",
    time_limit=2,
    soft_time_limit=1,
    retry=RetryPolicy(max_attempts=2, base_delay=0.2, jitter=False),
)
def hard_limited(key: str) -> None:
    mark(key)
    while True:  # swallows the soft limit, as code stuck in a C call would: only the kill ends it
        with contextlib.suppress(SoftTimeLimitExceeded):
            time.sleep(0.05)


@job(name="tests.crashes", retry=RetryPolicy(max_attempts=1))
def crashes(key: str, times: int) -> str:
    """Kills its own pool process the first `times` runs (a segfault, an OOM kill)."""
    if mark(key) <= times:
        os.kill(os.getpid(), signal.SIGKILL)
    return "survived"


@job(
    name="tests.http_call",
    retry=RetryPolicy(max_attempts=4, base_delay=0.2, factor=1.0, jitter=False, max_delay=5.0),
)
def http_call(url: str) -> int:
    """GETs `url` with requests; jobs.core.http decides on the status (a test's local server
    answers)."""
    import requests  # here, not at the top: only this job needs it

    from jobs.core.http import raise_for_status

    return raise_for_status(requests.get(url, timeout=5)).status_code


@job(name="tests.cooperative", bind=True)
def cooperative(self: Any, key: str, seconds: float = 30, children: int = 0) -> str:
    """Works in small steps, reporting progress, until done or cancelled; may first fan out
    `children` jobs on the `reports` queue (which only tests' own workers consume)."""
    for index in range(children):
        prioritized.enqueue(key, f"child-{index}")
    mark(key, "started")
    deadline = time.monotonic() + seconds
    step = 0
    try:
        while time.monotonic() < deadline:
            step += 1
            self.progress(step)
            time.sleep(0.05)
    except JobCancelled:
        mark(key, "stopped")
        raise
    return "finished"


@job(name="tests.terminated", cancel="terminate", retry=RetryPolicy(max_attempts=1))
def terminated(key: str) -> None:
    """Waits on a child process, as a job running ffmpeg does: only terminating it stops it.
    Marks "returned" if its code outlives its child (a terminate must kill the run first)."""
    child = subprocess.Popen(["sleep", "60"])
    redis_client().set(f"test:{key}:child", child.pid, ex=120)
    mark(key, "started")
    child.wait()
    mark(key, "returned")


@job(name="tests.total")
def total(values: list[int]) -> int:
    """A chord body: the sum of its header's results."""
    return sum(values)


@job(name="tests.fan_out")
def fan_out(kind: str) -> dict[str, Any]:
    """Sends a "group" or a "chord" of add jobs and one plain child job from inside a
    transaction, as a job that records its plan first would; returns their ids."""
    from typing import cast

    from celery import chord, group
    from celery.result import GroupResult
    from django.db import transaction

    members = [add.si(1, 2), add.si(3, 4)]
    ids: dict[str, Any] = {}
    with transaction.atomic():
        if kind == "chord":
            body = chord(members, total.s()).apply_async()
            header = cast(GroupResult, body.parent)
            ids.update(body=body.id, members=[r.id for r in header.results or []])
        else:
            # celery-types types a group's apply_async as returning an AsyncResult
            sent = cast(GroupResult, group(members).apply_async())
            ids.update(group=sent.id, members=[r.id for r in sent.results or []])
        ids["child"] = add.enqueue(5, 6).id
    return ids


@job(name="tests.fails_then_hangs", retry=RetryPolicy(max_attempts=2, base_delay=0.2, jitter=False))
def fails_then_hangs(key: str, seconds: float) -> str:
    """Fails its first run; the second sleeps `seconds` (a per-call time limit should end it)."""
    if mark(key) == 1:
        raise ConnectionError("the first run fails")
    time.sleep(seconds)
    return "slept"


@job(
    name="tests.unreachable",
    queue="reports",  # left to tests' own workers (tests/jobs/web/test_errors.py starts one)
    retry=RetryPolicy(max_attempts=3, base_delay=0.2, factor=1.0, jitter=False),
)
def unreachable(key: str, to: str) -> None:
    """Fails every run with a transient error quoting its address: retried twice, then dead."""
    mark(key)
    raise ConnectionError(f"could not reach the mailbox of {to}")


# --- batches (tests/jobs/flow/test_batches.py) ----------------------------------------------------
def _batch_fixed(key: str) -> bool:
    return bool(redis_client().exists(f"test:flag:fixed:{key}"))


@job(name="tests.batch_member", retry=RetryPolicy(max_attempts=1))
def batch_member(key: str, index: int, fails: bool = False, seconds: float = 0.0) -> int:
    """A batch member: records its run; one that `fails` gives up at once (Permanent) until
    its cause is fixed (the test sets test:flag:fixed:<key>)."""
    if seconds:
        time.sleep(seconds)
    mark(f"{key}:runs", index)
    if fails and not _batch_fixed(key):
        raise Permanent(f"member {index} cannot be processed")
    return index


@job(name="tests.batch_callback")
def batch_callback(batch_id: str, key: str, kind: str) -> None:
    """A batch callback: records which batch fired which kind."""
    mark(f"{key}:{kind}", batch_id)


@job(name="tests.batch_adder")
def batch_adder(key: str, more: int) -> int:
    """A member that adds `more` members to its own batch while it runs."""
    import jobs

    with jobs.batch(jobs.current_batch()):
        for index in range(more):
            batch_member.enqueue(key, 1000 + index)
    return more


@job(name="tests.batch_nester")
def batch_nester(key: str, members: int) -> str:
    """A member that opens a child batch of `members` slow members (it is the child's parent's)."""
    import jobs

    with jobs.batch(
        description="child", on_complete=batch_callback.s(key, "child_complete")
    ) as child:
        for index in range(members):
            batch_member.enqueue(key, 2000 + index, seconds=0.2)
    return str(child.id)


# Jobs behind concurrency and rate limits (tests/jobs/broker/test_concurrency_limits.py):
# registered in every test worker, which import this module.
from tests.support import limited_tasks as limited_tasks  # noqa: E402
