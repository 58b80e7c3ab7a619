"""Lost workers: what a dead worker held never waits for the visibility timeout, and a job that
takes its whole worker down ends in the dead letters.

The emails worker as the Procfile starts it (make run's sizes: -c 2, prefetch 4, so 8 messages
taken from Redis at a time), the real relay command, the shipped visibility timeout (2 h).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest

from jobs.broker.redis import redis_text as text
from jobs.broker.reservations import DROPPED, OWNERS, RESTORED
from jobs.core.states import WAITING_STATES
from jobs.models import DeadLetter, Job, JobState
from tests.conftest import wait_until
from tests.system.faults.conftest import (
    PrivateRedis,
    applied,
    figures,
    finished_count,
    running_ids,
    runs,
    states,
    wait_finished,
)
from tests.system.faults.lost import Process, ProcfileWorker, procfile_command

JOBS = 120
SECONDS = 0.4  # per job: 8 held per worker are 1.6 s of its work


@pytest.fixture
def lost_env(fault_env: dict[str, str]) -> dict[str, str]:
    """The fault suite's environment with the shipped broker timings, not its 10 s visibility
    timeout: nothing here may come back through the visibility timeout."""
    return {
        **fault_env,
        "CELERY_VISIBILITY_TIMEOUT": "7200",
        "BACKLOT_MAX_BROKER_COUNTDOWN": "900",
        "BACKLOT_RATE_LIMIT_MAX_RESERVE": "30",
    }


class Platform:
    """The processes a test controls: emails workers, the relay, beat."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.processes: list[Process] = []

    def worker(self, name: str, wait: bool = True) -> ProcfileWorker:
        worker = ProcfileWorker(name, self.env, wait=wait)
        self.processes.append(worker)
        return worker

    def relay(self) -> Process:
        argv = [sys.executable, "-m", "tests.system.faults.lost", "relay", json.dumps({})]
        self.processes.append(Process("relay", argv, self.env))
        return self.processes[-1]

    def beat(self) -> Process:
        self.processes.append(Process("beat", procfile_command("beat", self.env), self.env))
        return self.processes[-1]

    def kill_all(self) -> None:
        for process in self.processes:
            process.kill()

    def enqueue(self, task: str, run: str, count: int, **spec: Any) -> list[str]:
        import subprocess

        done = subprocess.run(
            [sys.executable, "-m", "tests.system.faults.lost", "enqueue",
             json.dumps({"task": task, "run": run, "count": count, **spec})],
            env=self.env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return list(json.loads(done.stdout.strip().splitlines()[-1])["ids"])


@pytest.fixture
def platform(lost_env: dict[str, str], transactional_db: None) -> Iterator[Platform]:
    started = Platform(lost_env)
    yield started
    for process in started.processes:
        process.stop()


def held_by(redis: PrivateRedis, node: str | None = None) -> dict[str, str]:
    """job id -> worker id of the messages taken from Redis and not acknowledged (of the
    workers named `node`, or of all)."""
    owners = {text(k): text(v) for k, v in redis.client.hgetall(OWNERS).items()}
    held = {}
    for tag, stored in redis.client.hgetall("unacked").items():
        owner = owners.get(text(tag), "")
        if node is None or owner.startswith(f"{node}:"):
            held[json.loads(stored)[0]["headers"]["id"]] = owner
    return held


def running_of(client: Any, held: dict[str, str]) -> set[str]:
    """The jobs among `held` that run: their row says so, or their run's Redis record does
    (DEFER_CLAIM: no row written yet)."""
    return running_ids(client, list(held))


def started_of(client: Any, held: dict[str, str]) -> set[str]:
    """The jobs among `held` that the ledger shows running or finished, or running unclaimed:
    a message the worker held after its job's finish (killed between the finish and the ack) is
    one the restore drops, as it drops a running job's."""
    rows = Job.objects.filter(id__in=list(held)).exclude(state__in=WAITING_STATES)
    ended = {str(job_id) for job_id in rows.values_list("id", flat=True)}
    return ended | running_ids(client, list(held))


def time_until(predicate: Callable[[], bool], since: float, timeout: float, what: str) -> float:
    wait_until(predicate, timeout=timeout, interval=0.2, what=what)
    return time.monotonic() - since


def succeeded(ids: list[str]) -> Callable[[], bool]:
    def check() -> bool:
        return Job.objects.filter(id__in=ids, state=JobState.SUCCEEDED).count() == len(ids)

    return check


def check_once(ids: list[str], run_id: str, held: dict[str, str], running: set[str]) -> dict:
    """Every job succeeded with its effect once; only the jobs running at the kill ran twice;
    the jobs no dead worker held were delivered once (none of a live worker re-sent)."""
    counts = states(ids)
    effects = applied(run_id)
    started = runs(run_id)
    rows = {str(j.id): j for j in Job.objects.filter(id__in=ids)}
    item = {job_id: rows[job_id].kwargs["item"] for job_id in ids}
    twice = [job_id for job_id in ids if started[item[job_id]] > 1]
    resent = [job_id for job_id in ids if job_id not in held and rows[job_id].deliveries != 1]
    assert counts[JobState.SUCCEEDED] == len(ids), dict(counts)
    assert len(effects) == len(ids) and max(effects.values()) == 1
    assert set(twice) <= running, f"{len(twice)} jobs ran twice, not all running at the kill"
    assert not resent, f"{len(resent)} messages of live workers were delivered again"
    return {"twice": len(twice), "resent": len(resent)}


def test_prefetched_jobs_of_a_killed_worker_run_within_60_s(
    private_redis: PrivateRedis, platform: Platform, run_id: str
) -> None:
    """kill -9 of an emails worker (main and pool processes) holding 8 messages, with a
    second one running: its prefetched jobs run on the other within 60 s (the visibility
    timeout is 2 h), each once; no message of the live worker is delivered twice."""
    platform.relay()
    first = platform.worker("lost-a")
    second = platform.worker("lost-b")
    ids = platform.enqueue("effect", run_id, JOBS, kwargs={"seconds": SECONDS})

    # when: the first worker holds its full prefetch and the backlog is far from drained
    wait_until(
        lambda: finished_count(ids) >= JOBS // 4 and len(held_by(private_redis, first.name)) == 8,
        timeout=120,
        interval=0.05,
        what="a quarter done and 8 messages held by the first worker",
    )
    first.kill()
    killed_at = time.monotonic()
    held = held_by(private_redis, first.name)
    running = running_of(private_redis.client, held)
    started = started_of(private_redis.client, held)
    prefetched = [job_id for job_id in held if job_id not in started]

    # then
    recovered = time_until(
        succeeded(prefetched), killed_at, 60, f"the {len(prefetched)} prefetched jobs"
    )
    wait_finished(ids, timeout=120, what="jobs after the kill")
    drained = time.monotonic() - killed_at
    outcome = check_once(ids, run_id, held, running)
    restored = int(private_redis.client.get(RESTORED) or 0)
    dropped = int(private_redis.client.get(DROPPED) or 0)
    figures(
        f"kill -9 of an emails worker (-c 2, prefetch 4, visibility timeout 7200 s) holding "
        f"{len(held)} ({len(prefetched)} prefetched, {len(running)} running, "
        f"{len(started) - len(running)} finished but not acknowledged): prefetched done "
        f"{recovered:.1f} s after the kill, all {JOBS} done at {drained:.1f} s; "
        f"{restored} messages restored, {dropped} of running or finished jobs dropped (a "
        f"running one's lease brought it back), {outcome['twice']} jobs ran twice (running at the "
        f"kill), {outcome['resent']} live worker's messages re-sent"
    )
    assert prefetched, "the kill caught no prefetched message; the test proved nothing"
    assert restored >= len(prefetched) and restored + dropped == len(held)
    second.stop()


def test_whole_platform_killed_and_restarted_on_the_same_redis(
    private_redis: PrivateRedis, platform: Platform, run_id: str
) -> None:
    """kill -9 of every platform process at once (both emails workers, the relay, beat: a lost
    host), then the same processes started again on the same Redis: what the dead workers
    had prefetched runs within 60 s of the kill, each job once."""
    platform.relay()
    platform.beat()
    platform.worker("whole-a")
    platform.worker("whole-b")
    ids = platform.enqueue("effect", run_id, JOBS, kwargs={"seconds": SECONDS})
    wait_until(
        lambda: finished_count(ids) >= JOBS // 4 and len(held_by(private_redis)) == 16,
        timeout=120,
        interval=0.05,
        what="a quarter done and 16 messages held",
    )

    # when
    platform.kill_all()
    killed_at = time.monotonic()
    held = held_by(private_redis)
    running = running_of(private_redis.client, held)
    started = started_of(private_redis.client, held)
    prefetched = [job_id for job_id in held if job_id not in started]
    platform.relay()
    platform.beat()
    platform.worker("whole-c")
    platform.worker("whole-d")
    restarted = time.monotonic() - killed_at

    # then
    recovered = time_until(
        succeeded(prefetched), killed_at, 60, f"the {len(prefetched)} prefetched jobs"
    )
    wait_finished(ids, timeout=150, what="jobs after the restart")
    drained = time.monotonic() - killed_at
    outcome = check_once(ids, run_id, held, running)
    restored = int(private_redis.client.get(RESTORED) or 0)
    dropped = int(private_redis.client.get(DROPPED) or 0)
    figures(
        f"kill -9 of the whole platform (2 emails workers, relay, beat) holding {len(held)} "
        f"({len(prefetched)} prefetched, {len(running)} running, "
        f"{len(started) - len(running)} finished), restarted in "
        f"{restarted:.1f} s: prefetched done {recovered:.1f} s after the kill, all {JOBS} at "
        f"{drained:.1f} s; {restored} restored, {dropped} dropped, {outcome['twice']} ran twice, "
        f"{outcome['resent']} re-sent"
    )
    assert prefetched, "the kill caught no prefetched message; the test proved nothing"
    assert restored >= len(prefetched) and restored + dropped == len(held)


def died_or_dead(worker: ProcfileWorker, job_id: str) -> bool:
    return worker.process.poll() is not None or (Job.objects.get(id=job_id).state == JobState.DEAD)


def test_a_job_that_kills_its_whole_worker_is_dead_lettered_after_max_crashes(
    private_redis: PrivateRedis, platform: Platform, run_id: str
) -> None:
    """A job that kills its worker's main process (and then its own pool process) is re-queued
    after each lease lapse, counted as a crash, until MAX_WORKER_CRASHES (3): then it is dead,
    with one dead letter, and runs no more. A worker is started again after each crash."""
    platform.env["BACKLOT_LEASE_SECONDS"] = "6"  # the lapses are the subject, not their length
    began = time.monotonic()
    platform.relay()
    [job_id] = platform.enqueue("kill_worker", run_id, 1)

    # when: each worker takes the job and dies; the next is started once it did
    workers = 0
    while Job.objects.get(id=job_id).state != JobState.DEAD:
        assert workers < 6, f"still {Job.objects.get(id=job_id).state} after {workers} workers"
        worker = platform.worker(f"crash-{workers}", wait=False)
        workers += 1
        wait_until(
            partial(died_or_dead, worker, job_id),
            timeout=90,
            interval=0.2,
            what="the worker to die, or the job to be dead",
        )
        worker.kill()  # what the job left of it (the other pool process)

    # then: a live worker gets whatever messages of the job are left, and drops them
    platform.worker("after")
    wait_until(
        lambda: not private_redis.unacked() and not private_redis.queue_depth("emails"),
        timeout=60,
        interval=0.2,
        what="the job's leftover messages to be dropped",
    )
    job = Job.objects.get(id=job_id)
    letter = DeadLetter.objects.get(job_id_value=job_id)
    started = runs(run_id)[0]
    figures(
        f"a job killing its whole worker: ran {started} times, {job.crashes} crashes counted "
        f"through lease lapses, state {job.state}, dead letter {letter.exception_class}; "
        f"{workers} workers started, {time.monotonic() - began:.1f} s"
    )
    assert job.state == JobState.DEAD and job.crashes == 3
    assert started == 3
    assert letter.exception_class == "billiard.exceptions.WorkerLostError"
    assert "lease lapsed" in letter.exception_message


def test_a_redis_restart_under_a_worker_strands_nothing_it_held(
    private_redis: PrivateRedis, platform: Platform, run_id: str
) -> None:
    """Redis restarted (AOF) while an emails worker holds its prefetch: the worker reconnects,
    and what it held before the restart (forgotten by Celery with the old connection, left in
    `unacked`, which kombu could not restore through the dead connection) runs within 60 s,
    not after the visibility timeout, each job once."""
    platform.relay()
    platform.worker("restart-a")
    ids = platform.enqueue("effect", run_id, 60, kwargs={"seconds": SECONDS})
    wait_until(
        lambda: finished_count(ids) >= 10 and len(held_by(private_redis)) == 8,
        timeout=120,
        interval=0.05,
        what="8 messages held",
    )

    # when
    private_redis.restart()
    restarted_at = time.monotonic()
    held = held_by(private_redis)

    # then
    recovered = time_until(
        succeeded(list(held)), restarted_at, 90, f"the {len(held)} jobs held at the restart"
    )
    wait_finished(ids, timeout=120, what="jobs after the restart")
    outcome = check_once(ids, run_id, held, set(held))
    restored = int(private_redis.client.get(RESTORED) or 0)
    dropped = int(private_redis.client.get(DROPPED) or 0)
    figures(
        f"Redis restart (AOF) under an emails worker holding {len(held)}: all done "
        f"{recovered:.1f} s after the restart; {restored} restored, {dropped} of finished jobs "
        f"dropped, {outcome['twice']} ran twice, {outcome['resent']} re-sent"
    )
    assert restored >= 1
