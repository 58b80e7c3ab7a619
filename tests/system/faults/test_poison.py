"""Fault 6: a poison job (always fails) among a thousand good ones."""

from __future__ import annotations

import time

from jobs.models import DeadLetter, Job, JobState
from tests.system.faults.conftest import applied, dead_letters, figures, runs, states, wait_finished
from tests.system.faults.jobs import QUICK_RETRY

GOOD = 1000
POISON_ITEM = 10_000


def test_poison_job_runs_max_attempts_then_one_dead_letter(
    private_redis, start_fault_worker, client_procs, run_id
):
    """One job that always raises a retryable error (max_attempts 3, 0.2 s delays) enqueued
    in the middle of 1,000 good ones.

    Pass figures: the poison job ran exactly 3 times, ledger attempts 3, state dead, exactly 1
    dead letter (its own); 1,000/1,000 good jobs succeeded with their effect once; within 120 s.
    """
    began = time.monotonic()
    good = client_procs.enqueue("effect", run_id, GOOD // 2, start=0, many=True)
    poison = client_procs.enqueue("poison", run_id, 1, start=POISON_ITEM)
    good += client_procs.enqueue("effect", run_id, GOOD // 2, start=GOOD // 2, many=True)

    # when
    start_fault_worker("poison", concurrency=2)

    # then
    drained = wait_finished(good + poison, timeout=120, what="good and poison jobs")
    started = runs(run_id)
    counts = states(good)
    effects = applied(run_id)
    bad = Job.objects.get(id=poison[0])
    letters = DeadLetter.objects.filter(job_id_value__in=good + poison)
    figures(
        f"poison among {GOOD}: poison ran {started[POISON_ITEM]} times (max_attempts "
        f"{QUICK_RETRY.max_attempts}), state {bad.state}, {letters.count()} dead letter; "
        f"{counts[JobState.SUCCEEDED]}/{GOOD} good succeeded, {len(effects)} effects, "
        f"{max(effects.values())} max per job, drained in {drained:.1f} s, "
        f"{time.monotonic() - began:.1f} s"
    )
    assert started[POISON_ITEM] == QUICK_RETRY.max_attempts == bad.attempts == 3
    assert bad.state == JobState.DEAD
    assert letters.count() == 1 and str(letters.get().job_id_value) == poison[0]
    assert (
        letters.get().attempts == 3
        and letters.get().exception_class == "jobs.core.policies.Retryable"
    )
    assert counts[JobState.SUCCEEDED] == GOOD, dict(counts)
    assert dead_letters(good) == 0
    assert len(effects) == GOOD and max(effects.values()) == 1
    assert all(started[item] == 1 for item in range(GOOD))
