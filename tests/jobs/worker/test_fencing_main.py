"""Fencing, round 2: a run that calls neither progress() nor effect_once is stopped by its
renewer before its lease expires, and the worker's main process's writes for a run (hard time
limit, terminating cancel, crash) are fenced by the run's claim like the run's own.

Real worker processes, Redis and PostgreSQL. A job sleeping in time.sleep whose renewals fail
(its worker cut off from the database by a TCP proxy, or its row locked by another
transaction) raises LeaseLost before the lease in the ledger expires. A worker whose pool
process is stopped (SIGSTOP) past its lease while another worker takes the job over, and whose
main process then records a hard time limit, a terminating cancel or the pool process's death
for it, leaves the second run's row as it was.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import psycopg
import pytest
from django.conf import settings

from config.celery import app as celery_app
from jobs.models import Job, JobState
from jobs.testing import Worker as PlatformWorker
from tests.conftest import LOG_DIR, ROOT, marks, set_flag, wait_until
from tests.jobs.worker.test_fencing import CuttableProxy, fencing_counts, relay_until
from tests.support import fencing_main_jobs

# Short leases so a takeover happens in seconds.
LEASE = "3"


class MainFencingWorker(PlatformWorker):
    """A real worker of the project on `reports` that loads this module's jobs."""

    def __init__(
        self, name: str, env: dict[str, str], concurrency: int = 1, pool: str = "prefork"
    ) -> None:
        super().__init__(
            "config",
            queues="reports",
            concurrency=concurrency,
            name=name,
            env=env,
            cwd=ROOT,
            log_dir=LOG_DIR,
            extra_args=[
                "-I",
                "tests.support.tasks,tests.support.fencing_main_jobs",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "-l",
                "INFO",
                "-P",
                pool,
            ],
        )


@pytest.fixture
def fencing_worker(
    worker_env: dict[str, str], clean_redis: None, transactional_db: None
) -> Iterator[Callable[..., MainFencingWorker]]:
    started: list[MainFencingWorker] = []

    def start(
        name: str, concurrency: int = 1, pool: str = "prefork", **env: str
    ) -> MainFencingWorker:
        worker = MainFencingWorker(name, {**worker_env, **env}, concurrency, pool)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        if worker.process.poll() is None:
            os.killpg(worker.process.pid, signal.SIGCONT)  # a stopped pool cannot stop
            worker.stop()


class ClosingProxy(CuttableProxy):
    """CuttableProxy whose cut also wakes its accept(): closing a listening socket alone
    leaves a thread blocked in accept() holding it open, so the first connection made after
    the cut still got through (to the worker's first reconnect, which then kept working)."""

    def cut(self) -> None:
        if self.listener is not None:
            with contextlib.suppress(OSError):
                self.listener.shutdown(socket.SHUT_RDWR)
        super().cut()


@pytest.fixture
def db_proxy() -> Iterator[CuttableProxy]:
    db = settings.DATABASES["default"]
    proxy = ClosingProxy((db["HOST"], int(db["PORT"])))
    yield proxy
    proxy.close()


def _renewed(job_id: str) -> Any:
    """Wait for a renewal of the job's lease to go through; returns the lease it left."""
    first = Job.objects.get(id=job_id).lease_expires_at
    return wait_until(
        lambda: (lease := Job.objects.get(id=job_id).lease_expires_at) != first and lease,
        timeout=30,
        what="a renewal of the lease",
    )


def _stopped_in_time(key: str, job_id: str, cut_at: float) -> float:
    """The sleeping job learnt LeaseLost before its lease in the ledger expired: the margin."""
    expires = Job.objects.get(id=job_id).lease_expires_at  # what the last renewal left
    assert expires is not None
    lost = wait_until(partial(marks, f"{key}:lost"), timeout=30, what="LeaseLost in the job")
    learnt_at, reason = lost[0]
    assert reason == "renewals failed"
    margin = expires.timestamp() - learnt_at
    assert margin > 0, (
        f"learnt {learnt_at - cut_at:.2f}s after the cut, lease expired "
        f"{expires.timestamp() - cut_at:.2f}s after it"
    )
    print(
        f"\nfencing: the sleeping job got LeaseLost {learnt_at - cut_at:.2f}s after the cut, "
        f"{margin:.2f}s before its lease expired"
    )
    return margin


def test_a_sleeping_job_whose_renewals_fail_is_stopped_before_its_lease_expires(
    fencing_worker: Callable[..., MainFencingWorker], db_proxy: CuttableProxy, unique: str
) -> None:
    # given: a worker that reaches PostgreSQL through a proxy, with 6 s leases, running a job
    # that sleeps in time.sleep: it never calls progress() or effect_once
    db = settings.DATABASES["default"]
    url = f"postgres://{db['USER']}:{db['PASSWORD']}@127.0.0.1:{db_proxy.port}/{db['NAME']}"
    worker = fencing_worker("main-fence-a", DATABASE_URL=url, BACKLOT_LEASE_SECONDS="6")
    handle = fencing_main_jobs.sleeper.enqueue(unique)
    wait_until(partial(marks, f"{unique}:running"), timeout=60, what="the job to run")
    _renewed(handle.id)

    # when: the database becomes unreachable for that worker (connections cut, new ones
    # refused): its renewals fail
    db_proxy.cut()
    cut_at = time.time()

    # then: the renewer stops the sleeping job (LeaseLost raised in its time.sleep) before
    # the lease the ledger holds expires
    _stopped_in_time(unique, handle.id, cut_at)
    # and once the database is back, the relay re-queues the job after its lease and the
    # worker runs it again to success
    db_proxy.open()
    relay_until(
        lambda: Job.objects.get(id=handle.id).state == JobState.SUCCEEDED,
        timeout=90,
        what="the job to run again",
    )
    job = Job.objects.get(id=handle.id)
    assert job.result == "run 2" and job.attempts == 2
    assert fencing_counts().get("lost:renewals_failed", 0) >= 1
    assert "Could not renew the lease" in worker.output()


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_a_sleeping_job_whose_row_is_locked_is_stopped_before_its_lease_expires(
    fencing_worker: Callable[..., MainFencingWorker], unique: str, pool: str
) -> None:
    # given: a worker with 6 s leases (a prefork pool, or -P solo: the job runs in the main
    # process's main thread) running a job that sleeps (no progress, no effects)
    fencing_worker(f"main-fence-{pool}", pool=pool, BACKLOT_LEASE_SECONDS="6")
    handle = fencing_main_jobs.sleeper.enqueue(unique)
    wait_until(partial(marks, f"{unique}:running"), timeout=60, what="the job to run")
    _renewed(handle.id)

    # when: another transaction locks the job's row: the renewal's UPDATE waits for it (it
    # neither fails nor returns)
    db = settings.DATABASES["default"]
    dsn = f"postgresql://{db['USER']}:{db['PASSWORD']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    with psycopg.connect(dsn) as locker:
        locker.execute(f"SELECT id FROM {Job._meta.db_table} WHERE id = %s FOR UPDATE", [handle.id])
        locked_at = time.time()

        # then: the renewer's schedule, which never waits on the database, stops the job
        # before its lease expires, while the renewal is still blocked
        _stopped_in_time(unique, handle.id, locked_at)
        locker.rollback()

    # and once the lock is gone, the stopped run frees its claim (it still held it) and hands
    # its message back: the job runs again to success, without a relay sweep
    wait_until(
        lambda: Job.objects.get(id=handle.id).state == JobState.SUCCEEDED,
        timeout=60,
        what="the job to run again",
    )
    job = Job.objects.get(id=handle.id)
    assert job.result == "run 2" and job.attempts == 2


def _taken_over(
    fencing_worker: Callable[..., MainFencingWorker],
    first: MainFencingWorker,
    ids: dict[str, str],
) -> tuple[MainFencingWorker, dict[str, int], dict[str, Job]]:
    """The jobs (key -> id) run on `first`: stop their pool processes (SIGSTOP) past the
    lease, let the relay re-queue them and a second worker take them over (each second run
    waits for its flag). Returns the second worker, the stopped pool pids and the rows as
    the second runs hold them."""
    keys = list(ids)
    pids = {
        key: int(wait_until(partial(marks, f"{key}:pid"), timeout=60, what=f"{key} to run")[0][1])
        for key in keys
    }
    assert set(pids.values()) <= set(first.pool_pids())
    # The first worker's main process goes on (its timers, its control commands), but takes
    # no more messages: the re-queued jobs go to the second worker.
    assert celery_app.control.cancel_consumer("reports", destination=[first.name], reply=True)
    for pid in pids.values():
        os.kill(pid, signal.SIGSTOP)  # the pool process only
    second = fencing_worker("main-fence-second", concurrency=len(keys))
    relay_until(
        lambda: all(marks(f"{key}:second") for key in keys),
        timeout=90,
        what="the second worker to take the jobs over",
    )
    rows = {key: Job.objects.get(id=ids[key]) for key in keys}
    for row in rows.values():
        assert row.state == JobState.RUNNING and row.attempts == 2
    return second, pids, rows


def _recorded(write: str, before: Job) -> bool:
    """The stale run's main process is done with its write: refused (counted), or it changed
    the second run's row (what the fence must prevent; _unchanged then says how)."""
    now = Job.objects.get(id=before.id)
    changed = (now.state, now.lease_owner, now.crashes, now.failures) != (
        before.state, before.lease_owner, before.crashes, before.failures,
    )  # fmt: skip
    return changed or fencing_counts().get(f"refused:{write}", 0) >= 1


def _gone(pid: int) -> bool:
    """The process has ended (gone, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _unchanged(before: Job) -> None:
    """The second run's row is as that run left it: running, its claim, no failure."""
    now = Job.objects.get(id=before.id)
    assert now.state == JobState.RUNNING, now.state
    assert now.lease_owner == before.lease_owner
    assert now.attempts == before.attempts and now.crashes == before.crashes
    assert now.failures == before.failures and now.error == before.error
    assert now.finished_at is None


def test_a_hard_time_limit_of_a_run_taken_over_leaves_the_new_run_alone(
    fencing_worker: Callable[..., MainFencingWorker], unique: str
) -> None:
    # given: worker A (3 s leases) runs a job with a 40 s hard time limit whose pool process
    # is stopped past its lease; worker B takes the job over (its run waits for a flag)
    first = fencing_worker("main-fence-limit", BACKLOT_LEASE_SECONDS=LEASE)
    job_id = fencing_main_jobs.held_limited.enqueue(unique).id
    _, pids, rows = _taken_over(fencing_worker, first, {unique: job_id})
    started = [at for at, _ in marks(f"{unique}:runs")]
    print(f"\nfencing: the second run started {started[1] - started[0]:.1f}s after the first")
    assert started[1] - started[0] < 35, "taken over too late: A's time limit may come first"

    # when: A's hard time limit fires for its stopped run: A's main process kills the pool
    # process and records the kill for the run it started
    wait_until(partial(_gone, pids[unique]), timeout=60, what="A's hard time limit")
    wait_until(partial(_recorded, "time_limit", rows[unique]), timeout=30, what="A's write")

    # then: the second run's row is untouched (no failed attempt, no retry, no dead letter),
    # and it finishes as its own run decides
    _unchanged(rows[unique])
    assert fencing_counts().get("refused:time_limit", 0) == 1
    assert "lost its claim; its time_limit was refused" in first.output()
    set_flag(f"{unique}:resume")
    wait_until(
        lambda: Job.objects.get(id=job_id).state == JobState.SUCCEEDED,
        timeout=60,
        what="the second run to finish",
    )
    assert Job.objects.get(id=job_id).result == "run 2"


def test_a_terminated_or_crashed_run_taken_over_leaves_the_new_run_alone(
    fencing_worker: Callable[..., MainFencingWorker], unique: str
) -> None:
    # given: worker A (3 s leases) runs two jobs whose pool processes are stopped past their
    # leases; worker B takes both over (their runs wait for a flag)
    first = fencing_worker("main-fence-stale", concurrency=2, BACKLOT_LEASE_SECONDS=LEASE)
    revoked, crashed = f"{unique}-t", f"{unique}-k"
    ids = {key: fencing_main_jobs.held.enqueue(key).id for key in (revoked, crashed)}
    _, pids, rows = _taken_over(fencing_worker, first, ids)

    # when: a terminating revoke reaches A alone for the first job (A kills its stopped pool
    # process and records the cancel), and A's other stopped pool process is killed (-9: A's
    # main process records the crash)
    celery_app.control.revoke(
        ids[revoked], terminate=True, signal="SIGKILL", destination=[first.name]
    )
    wait_until(partial(_recorded, "cancel", rows[revoked]), timeout=30, what="A's cancel")
    os.kill(pids[crashed], signal.SIGKILL)
    wait_until(partial(_recorded, "worker_lost", rows[crashed]), timeout=30, what="A's crash")

    # then: both second runs' rows are untouched (the revoke left its cancellation request,
    # which is the platform's record of a revoke), and they finish as their runs decide
    for key in (revoked, crashed):
        _unchanged(rows[key])
    counts = fencing_counts()
    assert counts.get("refused:cancel", 0) == 1 and counts.get("refused:worker_lost", 0) == 1
    log = first.output()
    assert "its cancel was refused" in log and "its worker_lost was refused" in log
    for key in (revoked, crashed):
        set_flag(f"{key}:resume")
    wait_until(
        lambda: Job.objects.filter(id__in=ids.values(), state=JobState.SUCCEEDED).count() == 2,
        timeout=60,
        what="the second runs to finish",
    )
