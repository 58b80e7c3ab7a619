"""Fault 4: Redis down (stopped, or frozen) while jobs are accepted."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from jobs.models import Job, JobState
from tests.conftest import ROOT
from tests.system.faults.conftest import applied, dead_letters, figures, runs, states, wait_finished

JOBS = 200
CLIENTS = 4  # API processes enqueuing at once, like gunicorn workers
ANSWER_WITHIN = 3.0  # seconds an enqueue may take while Redis is down ("a couple of seconds")


def enqueue_in_parallel(
    env: dict, run: str, total: int, clients: int, start: int = 0
) -> list[dict]:
    """`clients` processes, each calling enqueue() in a loop; their results (ids, slowest call)."""
    share = total // clients
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.system.faults.driver",
                "enqueue",
                json.dumps(
                    {"task": "effect", "run": run, "start": start + n * share, "count": share}
                ),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(clients)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_jobs_accepted_while_redis_is_stopped_all_run_once(
    private_redis, fault_env, start_fault_worker, client_procs, run_id
):
    """Redis stopped; 4 processes enqueue 200 jobs in a loop; Redis started again; a worker and
    the relay run.

    Pass figures: every enqueue returns within 3 s (the slowest is reported); all 200 rows wait
    unpublished in the ledger; once Redis is back 200/200 succeed, each run exactly once, 200
    effects, 0 duplicates, 0 dead letters; within 60 s of Redis coming back.
    """
    began = time.monotonic()
    private_redis.stop()

    # when
    results = enqueue_in_parallel(fault_env, run_id, JOBS, CLIENTS)
    ids = [job_id for result in results for job_id in result["ids"]]
    slowest = max(result["slowest"] for result in results)
    waiting = Job.objects.filter(
        id__in=ids, state=JobState.QUEUED, published_at__isnull=True
    ).count()
    private_redis.start()
    back = time.monotonic()
    start_fault_worker("outage", concurrency=2)
    client_procs.start_relay()

    # then
    recovered = wait_finished(ids, timeout=60, what="jobs accepted during the outage")
    counts = states(ids)
    effects = applied(run_id)
    started = runs(run_id)
    duplicates = sum(n - 1 for n in effects.values() if n > 1)
    figures(
        f"Redis stopped: {len(ids)} enqueues, slowest {slowest:.2f} s, "
        f"{waiting} waited in the outbox; "
        f"{counts[JobState.SUCCEEDED]}/{JOBS} succeeded, "
        f"runs per job {sorted(set(started.values()))}, "
        f"{len(effects)} effects, {duplicates} duplicates, {dead_letters(ids)} dead letters, "
        f"done {recovered:.1f} s after Redis came back, {time.monotonic() - began:.1f} s"
    )
    assert len(ids) == JOBS and slowest <= ANSWER_WITHIN
    assert waiting == JOBS
    assert counts[JobState.SUCCEEDED] == JOBS, dict(counts)
    assert len(started) == JOBS and set(started.values()) == {1}, "a job ran twice"
    assert len(effects) == JOBS and duplicates == 0
    assert dead_letters(ids) == 0
    assert time.monotonic() - back <= 60


FROZEN_JOBS = 3


def test_enqueue_against_a_frozen_redis_answers_within_seconds(
    private_redis, start_fault_worker, client_procs, run_id
):
    """Redis frozen (SIGSTOP: the port accepts connections, nothing answers); 3 enqueues; Redis
    thawed; a worker and the relay run.

    Pass figures: each enqueue returns within 3 s; 3/3 succeed once Redis is thawed, each run
    exactly once (a message the frozen Redis took late is a harmless duplicate), 0 duplicate
    effects.
    """
    began = time.monotonic()
    private_redis.freeze()
    try:
        result = client_procs.run("enqueue", task="effect", run=run_id, start=0, count=FROZEN_JOBS)
    finally:
        private_redis.thaw()
    ids = result["ids"]
    start_fault_worker("frozen", concurrency=2)
    client_procs.start_relay()

    recovered = wait_finished(ids, timeout=60, what="jobs accepted while Redis was frozen")
    counts = states(ids)
    effects = applied(run_id)
    started = runs(run_id)
    figures(
        f"Redis frozen: {len(ids)} enqueues, slowest {result['slowest']:.2f} s; "
        f"{counts[JobState.SUCCEEDED]}/{FROZEN_JOBS} succeeded, "
        f"runs per job {sorted(set(started.values()))}, "
        f"{len(effects)} effects, done {recovered:.1f} s after the thaw, "
        f"{time.monotonic() - began:.1f} s"
    )
    assert result["slowest"] <= ANSWER_WITHIN, (
        f"an enqueue took {result['slowest']:.2f} s against a frozen Redis"
    )
    assert counts[JobState.SUCCEEDED] == FROZEN_JOBS, dict(counts)
    assert set(started.values()) == {1} and len(started) == FROZEN_JOBS
    assert len(effects) == FROZEN_JOBS and max(effects.values()) == 1
