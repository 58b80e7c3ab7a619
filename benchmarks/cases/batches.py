"""Batches (issue 13): what joining a batch costs on the enqueue and on the drain.

1. Enqueue: a campaign-style fan-out (one transaction and one enqueue_many per 1,000 jobs)
   into one batch (its first chunk opens it, every later chunk joins it with
   ``jobs.batch(batch_id)``, the way emails.services.campaign_fan_out_run does) vs the same
   fan-out in no batch. No worker runs. Target: within 10 % (batch rate / plain rate >= 0.9).
2. Drain: one worker prefork -c 2 drains N ledger jobs that are members of a batch (each
   finish moves the batch's counters with its own write) vs the same N in no batch.
   Target: overhead per member <= 10 % (batch drain rate / plain drain rate >= 0.9).
3. Counts that do not depend on the machine's load, in this process: statements, client
   round trips and WAL bytes per member of an enqueue (per 1,000) and of a finish (one claim
   and its success, as a worker's pool process writes them), in one batch vs in no batch.
   During the drains, how often one of the worker's database sessions waited for a lock
   (pg_stat_activity sampled every 10 ms): the two pool processes finishing members of one
   batch meet on its counters row.

Each round times each variant's N in two halves, A B B A (B A A B the next round), so that a
load drifting during the round weighs on both alike; the enqueue's batch takes both halves
(the second joins it), each drain half is a batch of its own (N/2 members).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext

from benchmarks import jobs as bench
from benchmarks.cases.enqueue import FANOUT_CHUNK, fan_out
from benchmarks.harness import CaseResult, Workers, clock, empty_queues, pause, queued, timed_drain
from benchmarks.sizes import SIZES
from jobs import batch, ledger
from jobs import enqueue_many as job_enqueue_many
from jobs.models import Batch, BatchState, Job, JobState


def fan_out_in_batch(
    count: int, description: str = "bench batch", into: uuid.UUID | None = None
) -> uuid.UUID:
    """The fan-out of enqueue.fan_out with every job a member of one batch: the first chunk's
    transaction opens it (or joins `into`), each later chunk joins it in its own transaction."""
    batch_id = into
    for start in range(0, count, FANOUT_CHUNK):
        calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
            ((i,), {}) for i in range(start, min(count, start + FANOUT_CHUNK))
        ]
        with transaction.atomic():
            joining = batch(description=description) if batch_id is None else batch(batch_id)
            with joining as row:
                job_enqueue_many(task=bench.noop, calls=calls)
            batch_id = row.id
    assert batch_id is not None
    return batch_id


def _slots(round_no: int, names: list[str], count: int) -> list[tuple[str, int]]:
    """A round's timed slots, A B B A (B A A B every other round), each variant's `count` in
    two halves: a load that drifts during the round weighs on both variants alike."""
    a, b = names if round_no % 2 == 0 else list(reversed(names))
    first, second = count // 2, count - count // 2
    return [(a, first), (b, first), (b, second), (a, second)]


def run(*, full: bool = False) -> CaseResult:
    # the drain's size is the ledger drain's (drain_pg): the same jobs, the same worker
    enqueue_size, drain_size = SIZES["batches"], SIZES["drain_pg"]
    count, drain_count = enqueue_size.count(full), drain_size.count(full)
    result = CaseResult(
        case="batches",
        title="Batches: a batch's enqueue and drain vs the same jobs in no batch (PostgreSQL)",
        params={
            "enqueue_jobs_per_round": count,
            "drain_jobs_per_round": drain_count,
            "enqueue_rounds": enqueue_size.repeats,
            "drain_rounds": drain_size.repeats,
            "fan_out_chunk": FANOUT_CHUNK,
            "worker": "celery -A config worker -c 2 -P prefork",
        },
    )
    if count != enqueue_size.issue:
        result.notes.append(
            f"scaled: a {count:,}-member batch per round instead of {enqueue_size.issue:,}"
        )
    _enqueue(result, count, enqueue_size.repeats)
    _forget_enqueued()
    _counts(result)
    _forget_enqueued()
    _drain(result, drain_count, drain_size.repeats)
    return result


# --- what does not depend on load: statements, round trips, WAL per member ------------------
class Counted:
    """What this process sent through Django's cursors: statements, and client round trips
    (Django logs BEGIN and COMMIT, each its own round trip in psycopg 3, with the statements).
    COPY goes through psycopg's own cursor and is not counted (one per chunk in both)."""

    _CONTROL = ("BEGIN", "COMMIT", "ROLLBACK")

    def __init__(self) -> None:
        self.capture = CaptureQueriesContext(connection)
        self.wal = 0

    @contextmanager
    def counting(self) -> Iterator[Counted]:
        before = _wal()
        with self.capture:
            yield self
        self.wal = _wal() - before

    @property
    def statements(self) -> int:
        return sum(1 for q in self.capture.captured_queries if q["sql"] not in self._CONTROL)

    @property
    def round_trips(self) -> int:
        return len(self.capture.captured_queries)

    @property
    def transactions(self) -> int:
        return sum(1 for q in self.capture.captured_queries if q["sql"] == "BEGIN")


def _wal() -> int:
    """The WAL insert position in bytes (the bench's own PostgreSQL: nothing else writes)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn")
        return int(cursor.fetchone()[0])


COUNT_ENQUEUE = 2 * FANOUT_CHUNK  # two chunks: one opens the batch, one joins it
COUNT_FINISH = 200


def _counts(result: CaseResult) -> None:
    per: dict[str, Counted] = {}
    for name, send in (("no_batch", lambda n: fan_out(bench.noop, n)), ("batch", fan_out_in_batch)):
        empty_queues()
        per[name] = counted = Counted()
        with counted.counting():
            send(COUNT_ENQUEUE)
        empty_queues()
    for name, counted in per.items():
        scale = 1000 / COUNT_ENQUEUE
        result.figure(
            f"enqueue statements per 1,000, {name}",
            [counted.statements * scale],
            "statements",
            higher_is_better=False,
        )
        result.figure(
            f"enqueue round trips per 1,000, {name}",
            [counted.round_trips * scale],
            "round trips",
            higher_is_better=False,
        )
        result.figure(
            f"enqueue WAL per job, {name}",
            [counted.wal / COUNT_ENQUEUE],
            "bytes",
            higher_is_better=False,
        )
    finishes: dict[str, Counted] = {}
    for name, queue in (("no_batch", _queue_plain), ("batch", fan_out_in_batch)):
        before = set(Job.objects.filter(task_name=bench.noop.name).values_list("id", flat=True))
        queue(COUNT_FINISH)
        empty_queues()
        ids = [
            str(i)
            for i in Job.objects.filter(task_name=bench.noop.name, state=JobState.QUEUED)
            .exclude(id__in=before)
            .values_list("id", flat=True)
        ]
        finishes[name] = counted = Counted()
        with counted.counting():
            for job_id in ids:
                claim = ledger.claim(job_id=job_id, lease_seconds=60)
                if claim is None or not ledger.succeed(
                    job_id=job_id,
                    attempt=claim.attempt,
                    run_seconds=0.001,
                    lease_owner=claim.lease_owner,
                ):
                    raise AssertionError(f"{name}: job {job_id} was not claimed and finished")
    for name, counted in finishes.items():
        what = "one claim and its success, in this process"
        result.figure(
            f"finish statements per job, {name}",
            [counted.statements / COUNT_FINISH],
            "statements",
            higher_is_better=False,
            what=what,
        )
        result.figure(
            f"finish round trips per job, {name}",
            [counted.round_trips / COUNT_FINISH],
            "round trips",
            higher_is_better=False,
            what=what,
        )
        result.figure(
            f"finish WAL per job, {name}",
            [counted.wal / COUNT_FINISH],
            "bytes",
            higher_is_better=False,
        )
    connection.close()


class LockWaits:
    """Samples pg_stat_activity every 10 ms on a connection of its own: how often a session
    of the worker (its pool processes' database sessions) was waiting for a lock."""

    def __init__(self) -> None:
        self.samples = self.waiting = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LockWaits:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        own = connections.create_connection("default")
        try:
            with own.cursor() as cursor:
                while not self._stop.wait(0.01):
                    cursor.execute(
                        "SELECT count(*) FILTER (WHERE wait_event_type = 'Lock') "
                        "FROM pg_stat_activity WHERE datname = current_database() "
                        "AND pid <> pg_backend_pid() AND state = 'active'"
                    )
                    self.samples += 1
                    self.waiting += int(cursor.fetchone()[0])
        finally:
            own.close()

    @property
    def share(self) -> float:
        return self.waiting / self.samples if self.samples else 0.0


def _enqueue(result: CaseResult, count: int, repeats: int) -> None:
    variants: dict[str, tuple[Callable[[int], object], str]] = {
        "enqueue_many_no_batch": (
            lambda n: fan_out(bench.noop, n),
            "enqueue_many per 1,000 in a transaction, ledger on, no batch",
        ),
        "enqueue_many_one_batch": (
            fan_out_in_batch,
            "the same fan-out, every chunk joining one batch (jobs.batch(batch_id))",
        ),
    }
    for send, _ in variants.values():  # warm-up: imports, connections, caches
        send(100)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for round_no in range(repeats):
        seconds = dict.fromkeys(variants, 0.0)
        opened: uuid.UUID | None = None  # the round's batch: its second half joins it
        for name, n in _slots(round_no, list(variants), count):
            empty_queues()
            started = clock()
            if name == "enqueue_many_one_batch":
                opened = fan_out_in_batch(n, into=opened)
            else:
                variants[name][0](n)
            seconds[name] += clock() - started
            if queued() != n:
                raise AssertionError(f"{name}: {queued()} messages queued, expected {n}")
            connection.close()
        assert opened is not None
        total = Batch.objects.values_list("total", flat=True).get(id=opened)
        if total != count:
            raise AssertionError(
                f"round {round_no + 1}: the batch has {total} members, not {count}"
            )
        for name in variants:
            rates[name].append(count / seconds[name])
        connection.close()
    empty_queues()
    for name, (_, what) in variants.items():
        result.figure(name, rates[name], "jobs/s", what=what)
    ratio = result.ratio(
        "one_batch / no_batch (enqueue)",
        rates["enqueue_many_one_batch"],
        rates["enqueue_many_no_batch"],
    )
    result.target(
        f"{count:,}-member batch enqueue / enqueue_many without a batch",
        ratio,
        ">= 0.9 (within 10 %)",
        ratio >= 0.9,
    )


def _forget_enqueued() -> None:
    """Drop the enqueue rounds' ledger rows and batches (their messages were dropped from
    Redis): a worker's recovery would otherwise re-publish them into the drain's backlog."""
    with connection.cursor() as cursor:
        cursor.execute(f"truncate {Job._meta.db_table}, {Batch._meta.db_table} cascade")
    connection.close()


def _queue_plain(count: int) -> uuid.UUID | None:
    for start in range(0, count, FANOUT_CHUNK):
        with transaction.atomic():
            job_enqueue_many(
                task=bench.noop,
                calls=[((i,), {}) for i in range(start, min(count, start + FANOUT_CHUNK))],
            )
    return None


def _drain(result: CaseResult, count: int, repeats: int) -> None:
    variants: dict[str, tuple[Callable[[int], uuid.UUID | None], str]] = {
        "drain_no_batch": (_queue_plain, "ledger-on drain, jobs in no batch"),
        "drain_one_batch": (
            fan_out_in_batch,
            "ledger-on drain, every job a member of one batch (counters move on each finish)",
        ),
    }
    rates: dict[str, list[float]] = {name: [] for name in variants}
    waits: dict[str, list[float]] = {name: [] for name in variants}
    empty_queues()
    with Workers() as workers:
        worker = workers.start("batches", concurrency=2)
        worker.wait_ready()
        pause([worker])
        for round_no in range(-1, repeats):  # round -1 warms up with 200 jobs per variant
            n = 200 if round_no < 0 else count
            seconds = dict.fromkeys(variants, 0.0)
            sampled_share: dict[str, list[float]] = {name: [] for name in variants}
            for name, half in _slots(round_no, list(variants), n):
                succeeded_before = Job.objects.filter(
                    task_name=bench.noop.name, state=JobState.SUCCEEDED
                ).count()
                batch_id = variants[name][0](half)
                connection.close()
                with LockWaits() as sampled:
                    seconds[name] += timed_drain([worker], timeout=600)
                sampled_share[name].append(sampled.share)
                done = (
                    Job.objects.filter(task_name=bench.noop.name, state=JobState.SUCCEEDED).count()
                    - succeeded_before
                )
                if done != half:
                    result.notes.append(f"{name} round {round_no + 1}: {done} of {half} succeeded")
                if batch_id is not None:
                    row = Batch.objects.get(id=batch_id)
                    if row.state != BatchState.SUCCEEDED or row.succeeded != half:
                        result.notes.append(
                            f"{name} round {round_no + 1}: batch {row.state}, "
                            f"{row.succeeded} of {half} succeeded by its counters"
                        )
                connection.close()
            if round_no >= 0:
                for name in variants:
                    rates[name].append(n / seconds[name])
                    waits[name].append(sum(sampled_share[name]) / len(sampled_share[name]))
    for name, (_, what) in variants.items():
        result.figure(name, rates[name], "jobs/s", what=what)
    for name in variants:
        result.figure(
            f"{name}: sessions waiting for a lock",
            waits[name],
            "per sample",
            higher_is_better=False,
            what="pg_stat_activity every 10 ms: sessions in a Lock wait (mean per sample)",
        )
    ratio = result.ratio(
        "one_batch / no_batch (drain)", rates["drain_one_batch"], rates["drain_no_batch"]
    )
    result.target(
        "batch overhead per member on the drain (batch drain rate / plain drain rate)",
        ratio,
        ">= 0.9 (overhead <= 10 %)",
        ratio >= 0.9,
        detail=f"overhead {100 * (1 / ratio - 1):.1f} % per member" if ratio else "",
    )
