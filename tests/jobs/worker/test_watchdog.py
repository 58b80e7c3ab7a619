"""jobs.worker.watchdog's soft limit in this process's main thread (what a `-P solo` worker
does around a run); the hard limit's restart is tests/system/faults/test_solo_limits.py's."""

from __future__ import annotations

import signal
import time
from types import SimpleNamespace

import pytest
from billiard.exceptions import SoftTimeLimitExceeded

from jobs.worker import watchdog
from tests.conftest import wait_until


@pytest.fixture
def solo_worker():
    saved = (watchdog._worker.enforcing, watchdog._worker.soft, watchdog._worker.hard)
    watchdog.enable(soft=None, hard=None)
    yield
    watchdog._worker.enforcing, watchdog._worker.soft, watchdog._worker.hard = saved


def a_task(soft=None, hard=None, timelimit=None):
    return SimpleNamespace(
        request=SimpleNamespace(timelimit=timelimit), soft_time_limit=soft, time_limit=hard
    )


def alarm_as_before(before: tuple[float, float]) -> bool:
    """No alarm of ours is left; one set before the run (pytest-timeout's) runs on."""
    now = signal.getitimer(signal.ITIMER_REAL)
    return now == (0.0, 0.0) if before[0] == 0 else 0 < now[0] <= before[0]


def test_the_soft_limit_raises_in_the_run_and_the_alarm_is_gone_after_it(solo_worker):
    before = signal.getsignal(signal.SIGALRM)
    timer = signal.getitimer(signal.ITIMER_REAL)
    with (
        pytest.raises(SoftTimeLimitExceeded),
        watchdog.limited(a_task(soft=0.2), job_id="j", attempt=1, lease_owner=None),
    ):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the run's code: only the soft limit ends it
            time.sleep(0.01)
    assert alarm_as_before(timer)
    assert signal.getsignal(signal.SIGALRM) == before


def test_a_run_that_ends_in_time_is_not_interrupted(solo_worker):
    timer = signal.getitimer(signal.ITIMER_REAL)
    with watchdog.limited(a_task(soft=30, hard=60), job_id="j", attempt=1, lease_owner=None):
        pass
    assert alarm_as_before(timer)


def test_the_message_limits_come_before_the_tasks_and_the_workers(solo_worker):
    watchdog.enable(soft=100, hard=200)
    assert watchdog.limits(a_task()) == (100.0, 200.0)
    assert watchdog.limits(a_task(soft=10, hard=20)) == (10.0, 20.0)
    assert watchdog.limits(a_task(soft=10, hard=20, timelimit=(4, 3))) == (3.0, 4.0)


def test_outside_a_solo_worker_nothing_is_armed():
    before = signal.getsignal(signal.SIGALRM)
    with watchdog.limited(a_task(soft=0.01), job_id="j", attempt=1, lease_owner=None):
        time.sleep(0.05)  # no alarm: the pool enforces limits, or none apply (eager, web)
        assert signal.getsignal(signal.SIGALRM) == before


def test_the_hard_limit_of_a_run_shorter_than_the_one_before_is_kept(monkeypatch):
    # given a watchdog whose thread sleeps until a long run's deadline (60 s), the run ended,
    # and what its restart of the worker process would do recorded instead
    restarted: list[str] = []
    monkeypatch.setattr(watchdog, "_restart", lambda run: restarted.append(run.job_id))
    dog = watchdog._Watchdog()
    long_run = watchdog._Run("long", 1, None, 60, time.monotonic() + 60)
    dog.watch(long_run)
    # (the thread waits on its Condition: CPython's Condition keeps its waiters in _waiters)
    sleeping = lambda: dog.lock._waiters  # type: ignore[attr-defined]  # noqa: E731
    wait_until(sleeping, timeout=10, interval=0.01, what="the thread to sleep")
    dog.ended(long_run)

    # when runs of the same long limit come and go, and then one of 0.2 s outlives its limit
    for n in range(3):
        run = watchdog._Run(f"same-{n}", 1, None, 60, time.monotonic() + 60)
        dog.watch(run)
        dog.ended(run)
    dog.watch(watchdog._Run("short", 1, None, 0.2, time.monotonic() + 0.2))

    # then the short one is ended at its limit, not at the long one's; no other run is
    wait_until(lambda: restarted, timeout=10, interval=0.05, what="the short run's restart")
    assert restarted == ["short"]
