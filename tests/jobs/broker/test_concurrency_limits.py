"""Concurrency limits per key and the rate limiter's waiting room (issue 13, items 2 and 3),
against real worker processes, the real Redis and PostgreSQL.

Jobs that find no slot wait at their gate in Redis (jobs.broker.concurrency): no pool process held,
no attempt spent, re-published once when a slot frees. What a user sees is checked: the ledger's
running rows per key, start times, attempts, the re-send counter.
"""

from __future__ import annotations

import bisect
import itertools
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from django.db import transaction
from django.db.models import Count, Sum

from jobs import cancel, enqueue_many
from jobs.broker.concurrency import CONC_PREFIX, Gate, Gates
from jobs.broker.gate_counts import PARKED, RATE_LIMITED, RESENDS, counted
from jobs.broker.ratelimit import parse_rate
from jobs.broker.slots import job_gate
from jobs.flow.relay import job_relay
from jobs.models import Job, JobState
from tests.conftest import Worker, marks, set_flag, wait_until
from tests.support import limited_tasks as limited

pytestmark = pytest.mark.timeout(300)

# The fairness case's backlog: the 10,000 with BACKLOT_FAIRNESS_JOBS=10000; the default
# keeps the test under 90 s on the 2-core CI machine.
FAIRNESS_JOBS = int(os.environ.get("BACKLOT_FAIRNESS_JOBS", "2000"))
FAIRNESS_BOUND = 5.0  # seconds another tenant's single job may wait behind that backlog


@pytest.fixture(scope="module")
def two_workers(start_worker: Callable[..., Worker]) -> Iterator[list[Worker]]:
    """Two worker processes (3 pool processes each) on the queues the limited jobs use,
    stopped when this module ends: left running, they take `default` messages that later
    modules' tests wait for their own worker to run."""
    started = [
        # an idle worker's stop need not take the platform's 30 s soft shutdown
        start_worker(
            f"limits{i}",
            queues="default,emails",
            concurrency=3,
            CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT="2",
        )
        for i in (1, 2)
    ]
    yield started
    for worker in started:
        worker.stop()


@pytest.fixture
def workers(
    two_workers: list[Worker], clean_redis: None, transactional_db: None
) -> Iterator[list[Worker]]:
    yield two_workers


def running_per_key(task: str) -> Counter[str]:
    """Ledger rows of `task` in state running, per tenant kwarg."""
    rows = (
        Job.objects.filter(task_name=task, state=JobState.RUNNING)
        .values_list("kwargs__tenant")
        .annotate(n=Count("id"))
        .order_by()
    )
    return Counter(dict(rows))


def states(task: str) -> Counter[str]:
    rows = Job.objects.filter(task_name=task).values_list("state").annotate(n=Count("id"))
    return Counter(dict(rows.order_by()))


def enqueue_calls(task: Any, calls: list[tuple[tuple, dict]]) -> list[str]:
    ids: list[str] = []
    for start in range(0, len(calls), 1000):
        with transaction.atomic():
            ids += enqueue_many(task=task, calls=calls[start : start + 1000])
    return ids


def resends_per_job(task: str, jobs: int) -> float:
    return counted(RESENDS, [task])[task] / jobs


def peak(starts: list[float], seconds: float) -> int:
    """Most starts inside any window of `seconds` (sliding, anchored at each start)."""
    return max(bisect.bisect_left(starts, t + seconds) - i for i, t in enumerate(starts))


# --- concurrency ----------------------------------------------------------------------------


def test_at_most_two_per_key_run_at_once_across_two_workers(workers, unique):
    # given: 50 jobs of tenant a and 50 of tenant b, at most 2 per tenant at once, on two
    # worker processes with 6 pool processes between them
    calls = [((), {"key": unique, "tenant": t, "seconds": 0.15}) for t in "ab" for _ in range(50)]

    # when
    enqueue_calls(limited.pair, calls)

    # then: sampled from the ledger while they drain, never more than 2 running per tenant
    seen: Counter[str] = Counter()

    def drained() -> bool:
        now = running_per_key(limited.pair.name)
        assert all(n <= 2 for n in now.values()), f"more than 2 running for a key: {now}"
        for tenant, n in now.items():
            seen[tenant] = max(seen[tenant], n)
        return states(limited.pair.name)[JobState.SUCCEEDED] == 100

    wait_until(drained, timeout=120, interval=0.02, what="the 100 limited jobs")
    assert seen == {"a": 2, "b": 2}, f"the limit was never used in full: {seen}"
    # no attempt spent while waiting, and each waiter re-sent about once
    totals = Job.objects.filter(task_name=limited.pair.name).aggregate(a=Sum("attempts"))
    assert totals["a"] == 100
    assert resends_per_job(limited.pair.name, 100) < 1.5
    assert len(marks(unique)) == 100
    # and each waiter started within a second of a slot of its key freeing: the k-th start of
    # a tenant follows the (k-2)-th end (2 slots)
    for tenant in "ab":
        starts = sorted(at for at, t in marks(unique) if t == tenant)
        ends = sorted(at for at, t in marks(f"{unique}:end") if t == tenant)
        gaps = [start - end for start, end in zip(starts[2:], ends, strict=False)]
        assert max(gaps) <= 1.0, f"{tenant}: a slot stayed free {max(gaps):.2f} s"


@pytest.mark.timeout(180 + FAIRNESS_JOBS // 10)
def test_a_tenants_backlog_does_not_delay_another_tenants_job(workers, unique):
    # given: tenant "big" with FAIRNESS_JOBS waiting jobs, 5 at once
    calls = [((), {"key": unique, "tenant": "big", "seconds": 0.01})] * FAIRNESS_JOBS
    enqueue_calls(limited.five, calls)

    # when: another tenant enqueues one job on the same queue right behind them
    enqueued = time.time()
    with transaction.atomic():
        (single,) = enqueue_many(
            task=limited.five,
            calls=[((), {"key": unique + "-small", "tenant": "small", "seconds": 0})],
        )

    # then: it starts within FAIRNESS_BOUND seconds, while the backlog waits its turn
    wait_until(lambda: marks(unique + "-small"), timeout=60, interval=0.05, what="the single job")
    started = marks(unique + "-small")[0][0]
    print(f"\nfairness: the single job started {started - enqueued:.2f} s after its enqueue")
    assert started - enqueued <= FAIRNESS_BOUND, f"waited {started - enqueued:.1f} s"
    assert running_per_key(limited.five.name)["big"] <= 5

    # and the backlog drains at 5 at once, each job sent again at most once or so
    def drained() -> bool:
        assert running_per_key(limited.five.name)["big"] <= 5
        return states(limited.five.name)[JobState.SUCCEEDED] == FAIRNESS_JOBS + 1

    wait_until(drained, timeout=120 + FAIRNESS_JOBS // 12, interval=0.1, what="the backlog")
    assert resends_per_job(limited.five.name, FAIRNESS_JOBS + 1) < 1.5
    assert Job.objects.get(id=single).attempts == 1


def test_a_mapping_gives_each_key_its_limit(workers, unique):
    calls = [((), {"key": unique, "tenant": "vip", "seconds": 0.1})] * 6

    enqueue_calls(limited.five, calls)

    def drained() -> bool:
        assert running_per_key(limited.five.name)["vip"] <= 1
        return states(limited.five.name)[JobState.SUCCEEDED] == 6

    wait_until(drained, timeout=60, interval=0.02, what="the vip jobs")
    starts = sorted(at for at, _ in marks(unique))
    assert all(b - a >= 0.09 for a, b in itertools.pairwise(starts)), starts


# --- the rate limiter -----------------------------------------------------------------------


def test_rate_limit_holds_in_every_second_on_two_workers(workers, unique):
    # given: 200 jobs behind a 20/s cluster-wide limit, enqueued at once
    rate = 1 / parse_rate(limited.RATE)
    jobs = 200

    # when
    enqueue_calls(limited.rated, [((), {"key": unique, "item": i}) for i in range(jobs)])
    wait_until(
        lambda: states(limited.rated.name)[JobState.SUCCEEDED] == jobs,
        timeout=120,
        interval=0.2,
        what="the rate-limited jobs",
    )

    # then: the busiest second within the limit + 10 %, the average within 5 %, each job sent
    # again about once (not once per second it waited)
    starts = sorted(at for at, _ in marks(unique))
    achieved = (len(starts) - 1) / (starts[-1] - starts[0])
    resent = resends_per_job(limited.rated.name, jobs)
    figures = f"peak {peak(starts, 1.0)}, {achieved:.2f}/s, re-sends {resent:.2f} per job"
    print(f"\nrate case: {figures}")
    # (+1: a start is stamped when the body runs, after its pickup; on 2 loaded cores one late
    # pickup lands in the next second's window: CI read 23 at 20/s twice, the average 20.05/s)
    assert peak(starts, 1.0) <= rate * 1.1 + 1, figures
    assert rate * 0.95 <= achieved <= rate * 1.05, figures
    assert resent < 1.5, figures
    totals = Job.objects.filter(task_name=limited.rated.name).aggregate(a=Sum("attempts"))
    assert totals["a"] == jobs


# --- releasing slots ------------------------------------------------------------------------


def stays(predicate: Callable[[], bool], seconds: float) -> None:
    """`predicate` holds for `seconds` (polled): what a leaked slot would break meanwhile."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert predicate()
        time.sleep(0.02)  # polling interval of a bounded check


def started_ids(key: str) -> list[str]:
    return [value.split(":", 1)[1] for _, value in marks(key) if value.startswith("start:")]


def test_cancelling_a_running_job_frees_its_slot_and_a_waiting_one_leaves(workers, unique):
    # given: one job of tenant t running (1 at once), two waiting
    flag = f"{unique}-go"
    first = limited.blocking.enqueue(key=unique, tenant="t", flag=flag)
    wait_until(lambda: started_ids(unique), timeout=30, what="the first job to start")
    second = limited.blocking.enqueue(key=unique, tenant="t", flag=flag)
    third = limited.blocking.enqueue(key=unique, tenant="t", flag=flag)
    gate = Gates()
    stored = gate.gate_of(first.id)
    assert stored is not None
    wait_until(lambda: gate.waiting(stored) == 2, timeout=30, what="two jobs waiting")
    stays(lambda: started_ids(unique) == [first.id], seconds=0.5)

    # when: the waiting third is cancelled, then the running first
    cancel(third.id)
    assert gate.waiting(stored) == 1
    cancelled = time.time()
    cancel(first.id)

    # then: the second starts within a second or so of the slot freeing; the third never runs
    wait_until(lambda: len(started_ids(unique)) == 2, timeout=15, what="the second job")
    assert started_ids(unique) == [first.id, second.id]
    assert marks(unique)[-1][0] - cancelled < 3
    set_flag(flag)
    wait_until(lambda: second.job().state == JobState.SUCCEEDED, timeout=30, what="the second")
    assert first.job().state == third.job().state == JobState.CANCELLED
    assert gate.holding(stored) == [] and gate.waiting(stored) == 0


def test_a_terminated_job_frees_its_slot(workers, unique):
    first = limited.terminated.enqueue(key=unique, tenant="t")
    wait_until(lambda: started_ids(unique), timeout=30, what="the first job to start")
    second = limited.terminated.enqueue(key=unique, tenant="t")
    stays(lambda: started_ids(unique) == [first.id], seconds=0.5)

    cancel(first.id)

    wait_until(lambda: len(started_ids(unique)) == 2, timeout=20, what="the second job")
    assert started_ids(unique)[1] == second.id
    cancel(second.id)
    wait_until(
        lambda: second.job().state == JobState.CANCELLED, timeout=30, what="the second cancelled"
    )


@pytest.mark.timeout(240)
def test_a_killed_workers_slot_frees_with_the_jobs_lease(
    start_worker, clean_redis, transactional_db, unique
):
    # given: two workers of their own (on `reports`) with a 3 s lease; one job of tenant t
    # running on the first, another waiting for its slot
    lease = 3.0
    env = {"BACKLOT_LEASE_SECONDS": str(lease), "CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT": "2"}
    doomed = start_worker(f"{unique[:6]}doomed", queues="reports", concurrency=1, **env)
    # (its workers are stopped whatever happens: one left consuming `reports` took a job of
    # the next test that ran in this process, test_pause's "19 of 20 waiting")
    flag = f"{unique}-go"
    survivor: Worker | None = None
    try:
        on_reports = limited.blocking.using(queue="reports")
        first = on_reports.enqueue(key=unique, tenant="t", flag=flag)

        # (with the relay's sweep, as beat runs it every 5 s: stop 42's clean-check saw this
        # job parked behind a holder of tenant t's slot that no test of its own had, which
        # lapsed with its lease; only a sweep or a release lets a waiter in after that)
        def first_started() -> list[str]:
            job_relay()
            return started_ids(unique)

        try:
            wait_until(first_started, timeout=60, interval=0.5, what="the first job to start")
        except AssertionError as exc:  # say where the job is
            raise AssertionError(f"{exc}; {_whereabouts(first.id, doomed)}") from None
        survivor = start_worker(f"{unique[:6]}survivor", queues="reports", concurrency=2, **env)
        second = on_reports.enqueue(key=unique, tenant="t", flag=flag)
        gates = Gates()
        gate = gates.gate_of(first.id)
        assert gate is not None
        wait_until(lambda: gates.waiting(gate) == 1, timeout=30, what="the second job waiting")

        # when: the first worker is killed (-9, with its pool process)
        os.killpg(doomed.process.pid, signal.SIGKILL)
        killed = time.time()
        doomed.process.wait(timeout=10)

        # then: once the dead run's lease lapsed, the key's slot is free again: the relay's sweep
        # lets the waiting job in (or the first job, re-queued, takes it back), one at a time
        def restarted() -> list[float]:
            job_relay()
            assert running_per_key(limited.blocking.name)["t"] <= 1 or not _lease_lapsed(first.id)
            return [at for at, value in marks(unique) if value.startswith("start:") and at > killed]

        again = wait_until(
            restarted, timeout=lease * 4 + 20, interval=0.5, what="a job of t to start"
        )
        assert again[0] - killed <= lease + 6, f"the slot came back {again[0] - killed:.1f} s after"
        holders = gates.holding(gate)
        assert len(holders) == 1 and holders[0] in (first.id, second.id)
        # and both finish, one after the other
        set_flag(flag)

        def both_done() -> bool:
            job_relay()
            return {first.job().state, second.job().state} == {JobState.SUCCEEDED}

        wait_until(both_done, timeout=90, interval=0.5, what="both jobs to succeed")
        assert gates.holding(gate) == [] and gates.waiting(gate) == 0
    finally:
        set_flag(flag)  # a blocking job still running ends
        for worker in (survivor, doomed):
            if worker is not None:
                worker.stop()


def _whereabouts(job_id: str, worker: Worker) -> str:
    """Where a job that did not start is: its row, its gate, its queue, the worker's log."""
    from jobs.broker.queues import queue_keys
    from jobs.broker.redis import redis_client

    row = Job.objects.filter(id=job_id).values("state", "published_at", "attempts").first()
    gates = Gates()
    gate = gates.gate_of(job_id)
    lines = {key: redis_client().llen(key) for key in queue_keys("reports")}
    gated = "none"
    if gate is not None:  # every holder, a lapsed one too, with its lease's end (Redis time)
        held = redis_client().zrange(CONC_PREFIX + gate.holders, 0, -1, withscores=True)
        now = sum(x / 10**6 if i else x for i, x in enumerate(redis_client().time()))
        gated = f"waiting {gates.waiting(gate)}, holders {held} at {now:.3f}"
    return (
        f"row {row}; gate: {gated}; reports lists {lines}; "
        f"worker log tail: {worker.output()[-1500:]}"
    )


def _lease_lapsed(job_id: str) -> bool:
    """The killed run's row still reads running until the relay sees its lease lapse."""
    job = Job.objects.get(id=job_id)
    return (
        job.state == JobState.RUNNING
        and job.lease_expires_at is not None
        and (job.lease_expires_at.timestamp() < time.time())
    )


def test_the_gate_of_a_call_names_its_key_and_limits():
    def gate_of(task: Any, kwargs: dict[str, Any]) -> Any:
        task.push_request(delivery_info={"routing_key": task.queue_name})
        try:
            return job_gate(task, (), kwargs)
        finally:
            task.pop_request()

    vip = gate_of(limited.five, {"tenant": "vip"})
    assert (vip.name, vip.holders, vip.limit, vip.bucket) == (
        "tests.limited.five:vip",
        "tests.limited.five:vip",
        1,
        "",
    )
    assert gate_of(limited.five, {"tenant": "x"}).limit == 5
    rated = gate_of(limited.rated, {"key": "k", "item": 1})
    assert (rated.bucket, rated.limit, rated.queue) == ("tests.limited.rate", 0, "emails")
    assert rated.interval == pytest.approx(0.05)
    assert gate_of(limited.add_unlimited, {}) is None


def test_bad_concurrency_is_refused_naming_it():
    from jobs.worker.decorators import job

    for bad in (0, -1, "2", 1.5, {"pro": 0}):
        with pytest.raises(ValueError, match="Invalid concurrency"):
            job(name=f"tests.bad_concurrency_{bad!r}", concurrency=bad)(lambda: None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="track=False"):
        job(name="tests.bad_concurrency_untracked", concurrency=2, track=False)(lambda: None)


def test_parked_counter_counts_waits(workers, unique):
    calls = [((), {"key": unique, "tenant": "c", "seconds": 0.05})] * 6
    enqueue_calls(limited.pair, calls)
    wait_until(
        lambda: states(limited.pair.name)[JobState.SUCCEEDED] == 6, timeout=60, what="6 jobs"
    )
    assert counted(PARKED, [limited.pair.name])[limited.pair.name] >= 4


# --- the gate's contract, on the real Redis -------------------------------------------------


@pytest.fixture
def gates(clean_redis: None) -> Gates:
    return Gates()


def conc_gate(limit: int = 2, lease: float = 30.0) -> Gate:
    return Gate(name="g:t", queue="default", holders="g:t", limit=limit, lease=lease)


def rate_gate(interval: float = 0.1) -> Gate:
    return Gate(name="r", queue="emails", bucket="r", interval=interval)


def test_a_full_key_parks_and_a_release_lets_the_oldest_waiter_in(gates):
    gate = conc_gate(limit=2)
    assert [gates.admit(gate, j, "{}", horizon=1).verdict for j in ("j1", "j2", "j3", "j4")] == [
        "go",
        "go",
        "parked",
        "parked",
    ]
    assert gates.admit(gate, "j3", "{}", horizon=1).verdict == "waiting"  # a duplicate
    assert gates.dispatch(gate, horizon=1) == []  # no slot free
    assert gates.waiting_queues() == {"default"}

    gates.release(gate, "j1")
    released = gates.dispatch(gate, horizon=1)

    assert [r.job_id for r in released] == ["j3"]
    assert sorted(gates.holding(gate)) == ["j2", "j3"]  # held for j3 on its way
    assert gates.admit(gate, "j3", "{}", horizon=1).verdict == "go"
    assert gates.admit(gate, "j5", "{}", horizon=1).verdict == "parked"  # j4 waits before it
    gates.release(gate, "j4")  # cancelled while waiting: it leaves the line
    gates.release(gate, "j2")
    assert [r.job_id for r in gates.dispatch(gate, horizon=1)] == ["j5"]
    assert gates.waiting(gate) == 0 and gates.waiting_queues() == set()


def test_a_redelivered_holder_keeps_its_slot_and_a_lapsed_one_frees_it(gates):
    gate = conc_gate(limit=1, lease=0.3)
    assert gates.admit(gate, "j1", "{}", horizon=1).verdict == "go"
    assert gates.admit(gate, "j1", "{}", horizon=1).verdict == "held"  # its own redelivery
    assert gates.admit(gate, "j2", "{}", horizon=1).verdict == "parked"

    # j1's worker died: nobody renews or releases its slot, which lapses with the lease
    wait_until(lambda: gates.dispatch(gate, horizon=1), timeout=5, interval=0.05, what="the lapse")
    assert gates.holding(gate) == ["j2"]


def test_jobs_parked_at_enqueue_leave_in_order_as_slots_free(gates):
    gate = conc_gate(limit=2)
    gates.wait([(gate, f"j{i}", f'{{"i": {i}}}') for i in range(5)])

    first = gates.dispatch(gate, horizon=1)

    assert [(r.job_id, r.message) for r in first] == [("j0", '{"i": 0}'), ("j1", '{"i": 1}')]
    gates.release(gate, "j0")
    assert [r.job_id for r in gates.dispatch(gate, horizon=1)] == ["j2"]


def test_a_park_counts_and_dispatches_in_its_one_round_trip_even_after_a_script_flush(gates):
    gate = conc_gate(limit=2)
    gates.wait([(gate, "j0", "{}")])
    counters = "backlot:metrics:test_parked"

    # when: Redis lost its scripts (a restart, SCRIPT FLUSH), then three more jobs park
    gates.client.script_flush()
    [released] = gates.park(
        [(gate, f"j{i}", f'{{"i": {i}}}') for i in (1, 2, 3)],
        dispatch=[(gate, 1.0)],
        counter=(counters, "t"),
    )

    # then: they parked behind j0, the dispatch let the two oldest in, the count is theirs
    assert [r.job_id for r in released] == ["j0", "j1"]
    assert sorted(gates.holding(gate)) == ["j0", "j1"] and gates.waiting(gate) == 2
    assert int(gates.client.hget(counters, "t")) == 3
    # and the scripts are back: a second park sends them as EVALSHA only
    [none] = gates.park([(gate, "j4", "{}")], dispatch=[(gate, 1.0)], counter=(counters, "t"))
    assert none == [] and gates.waiting(gate) == 3 and int(gates.client.hget(counters, "t")) == 4


def test_a_park_counts_the_jobs_left_waiting_for_a_rate_token_in_its_round_trip(gates, monkeypatch):
    # given: the scripts loaded (a first park loads them: a round trip of its own), and what the
    # gates' client sends Redis from then on, by round trip (pipelines)
    warm = Gate(name="warm", queue="emails", bucket="warm", interval=0.1)
    gates.park([(warm, "w0", "{}")], dispatch=[(warm, 1.0)], rate_waits="warm")
    gate = rate_gate(interval=0.1)
    trips: list[int] = []
    execute = redis.client.Pipeline.execute

    def counted_execute(pipe: Any, *args: Any, **kwargs: Any) -> Any:
        trips.append(len(pipe.command_stack))
        return execute(pipe, *args, **kwargs)

    monkeypatch.setattr(redis.client.Pipeline, "execute", counted_execute)

    # when: 30 jobs of task t park at a rate gate with its dispatch (an enqueue's park)
    [released] = gates.park(
        [(gate, f"j{i}", "{}") for i in range(30)],
        dispatch=[(gate, 1.0)],
        counter=(PARKED, "t"),
        rate_waits="t",
    )

    # then: a second's worth of tokens went out, and the rest are counted as waiting for a
    # later token (backlot_rate_limit_waits), in the park's one round trip
    assert 10 <= len(released) <= 11
    assert counted(RATE_LIMITED, ["t"]) == {"t": 30 - len(released)} == {"t": gates.waiting(gate)}
    assert len(trips) == 1, trips
    # a park at a gate without a rate (a concurrency limit only) counts no rate wait
    gates.park([(conc_gate(limit=1), f"c{i}", "{}") for i in range(3)], rate_waits="t")
    assert counted(RATE_LIMITED, ["t"]) == {"t": 30 - len(released)}


def test_rate_waiters_are_granted_one_token_each_an_interval_apart(gates):
    gate = rate_gate(interval=0.1)
    gates.wait([(gate, f"j{i}", "{}") for i in range(30)])

    released = gates.dispatch(gate, horizon=1.0)

    # a second's worth of tokens (10-11), each its own slot 0.1 s after the one before
    assert 10 <= len(released) <= 11
    waits = [r.wait for r in released]
    assert waits[0] == pytest.approx(0, abs=0.02)
    assert all(b - a == pytest.approx(0.1, abs=0.002) for a, b in itertools.pairwise(waits))
    # a granted job that arrives early is told to wait; on time, it goes
    second = released[1]
    early = gates.admit(gate, second.job_id, "{}", horizon=1)
    assert early.verdict == "early" and 0 < early.wait <= 0.11
    wait_until(
        lambda: gates.admit(gate, second.job_id, "{}", horizon=1).verdict == "go",
        timeout=1,
        interval=0.01,
        what="the granted slot's time",
    )
    # a newcomer does not jump the line
    assert gates.admit(gate, "late-comer", "{}", horizon=1).verdict == "parked"
