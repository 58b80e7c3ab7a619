"""Fault 2: SIGTERM (a deploy) while short and long jobs run."""

from __future__ import annotations

import signal
import subprocess
import time

from jobs.models import JobState
from tests.conftest import wait_until
from tests.system.faults.conftest import (
    applied,
    dead_letters,
    figures,
    running_ids,
    runs,
    states,
    wait_finished,
)

DRAIN = 6  # seconds the deploy recipe lets running jobs finish after SIGTERM
SHORT, LONG = 2.0, 20.0
# The platform's drain setting (config/settings.py); the worker gets plain SIGTERM, as from
# `docker compose stop`, Kubernetes or a Procfile runner.
DRAIN_ENV = {"CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT": str(DRAIN)}


def test_sigterm_finishes_short_jobs_and_hands_long_ones_back(
    private_redis, start_fault_worker, client_procs, run_id
):
    """SIGTERM to a worker running 4 short jobs (2 s) and 2 long ones (20 s), with a 6 s drain.

    Pass figures: the worker exits 0 within DRAIN + 5 s; the 4 short jobs finished there
    (succeeded, 1 run each, acknowledged: only the 2 long jobs' messages are left in Redis);
    the 2 long ones run again on a second worker and succeed (2 starts each); 6/6 succeeded,
    0 dead letters, 6 effects, 0 duplicates.
    """
    began = time.monotonic()
    first = start_fault_worker("term-a", concurrency=6, **DRAIN_ENV)
    # the long ones first: each enqueue is a process that takes ~3 s to start Django here,
    # longer than a short job, which would be over before the long ones were sent
    long = client_procs.enqueue("slow", run_id, 2, start=100, kwargs={"seconds": LONG})
    short = client_procs.enqueue("slow", run_id, 4, start=0, kwargs={"seconds": SHORT})
    wait_until(
        lambda: len(running_ids(private_redis.client, short + long)) == 6,
        timeout=30,
        interval=0.05,
        what="all six jobs to run",
    )

    # when
    first.process.send_signal(signal.SIGTERM)
    termed_at = time.monotonic()
    try:
        code = first.process.wait(timeout=LONG + 20)
    except subprocess.TimeoutExpired:
        code = None
    exit_after = time.monotonic() - termed_at
    left_in_redis = sorted(private_redis.queued_ids())
    short_states = states(short)
    short_runs = [runs(run_id)[i] for i in range(4)]

    second = start_fault_worker("term-b", concurrency=2)
    wait_finished(short + long, timeout=LONG + 40, what="jobs after the deploy")
    started = runs(run_id)
    effects = applied(run_id)
    counts = states(short + long)
    duplicates = sum(n - 1 for n in effects.values() if n > 1)
    figures(
        f"SIGTERM with {DRAIN} s drain: worker exit code {code} after {exit_after:.1f} s; "
        f"short jobs {short_states[JobState.SUCCEEDED]}/4 finished before exit "
        f"with runs {short_runs}; long jobs "
        f"started {[started[100], started[101]]} times; {counts[JobState.SUCCEEDED]}/6 succeeded, "
        f"{dead_letters(short + long)} dead letters, {duplicates} duplicates, "
        f"{time.monotonic() - began:.1f} s"
    )
    assert code == 0, f"worker exit code {code}:\n{first.output()[-2000:]}"
    assert exit_after <= DRAIN + 5, (
        f"worker took {exit_after:.1f} s to stop; the drain timeout is {DRAIN} s"
    )
    assert short_states[JobState.SUCCEEDED] == 4, dict(short_states)
    assert short_runs == [1, 1, 1, 1]
    assert left_in_redis == sorted(long), "only the long jobs go back to the queue"
    assert [started[100], started[101]] == [2, 2]
    assert "faults.slow" in second.output()
    assert counts[JobState.SUCCEEDED] == 6 and dead_letters(short + long) == 0
    assert len(effects) == 6 and duplicates == 0
