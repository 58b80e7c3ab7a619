"""Batches (issue 13): what joining a batch costs on the enqueue and on the drain.

1. Enqueue: a campaign-style fan-out (one transaction and one enqueue_many per 1,000 jobs)
   into one batch (its first chunk opens it, every later chunk joins it with
   ``jobs.batch(batch_id)``, the way emails.services.campaign_fan_out_run does) vs the same
   fan-out in no batch. No worker runs. Target: within 10 % (batch rate / plain rate >= 0.9).
2. Drain: one worker prefork -c 2 drains N ledger jobs that are members of one batch (each
   finish moves the batch's counters in its own transaction) vs the same N in no batch.
   Target: overhead per member <= 10 % (batch drain rate / plain drain rate >= 0.9).

Variants alternate within each round and the order flips every round.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from django.db import connection, transaction

from benchmarks import jobs as bench
from benchmarks.cases.enqueue import FANOUT_CHUNK, fan_out
from benchmarks.harness import CaseResult, Workers, clock, empty_queues, pause, queued, timed_drain
from benchmarks.sizes import SIZES
from jobs import batch
from jobs import enqueue_many as job_enqueue_many
from jobs.models import Batch, BatchState, Job, JobState


def fan_out_in_batch(count: int, description: str = "bench batch") -> uuid.UUID:
    """The fan-out of enqueue.fan_out with every job a member of one batch: the first chunk's
    transaction opens it, each later chunk joins it in its own transaction."""
    batch_id: uuid.UUID | None = None
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
    _drain(result, drain_count, drain_size.repeats)
    return result


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
        names = list(variants) if round_no % 2 == 0 else list(reversed(variants))
        for name in names:
            send = variants[name][0]
            empty_queues()
            started = clock()
            outcome = send(count)
            seconds = clock() - started
            if queued() != count:
                raise AssertionError(f"{name}: {queued()} messages queued, expected {count}")
            if isinstance(outcome, uuid.UUID):
                total = Batch.objects.values_list("total", flat=True).get(id=outcome)
                if total != count:
                    raise AssertionError(f"{name}: the batch has {total} members, not {count}")
            rates[name].append(count / seconds)
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
    empty_queues()
    with Workers() as workers:
        worker = workers.start("batches", concurrency=2)
        worker.wait_ready()
        pause([worker])
        for round_no in range(-1, repeats):  # round -1 warms up with 100 jobs per variant
            n = 100 if round_no < 0 else count
            names = list(variants) if round_no % 2 == 0 else list(reversed(variants))
            for name in names:
                succeeded_before = Job.objects.filter(
                    task_name=bench.noop.name, state=JobState.SUCCEEDED
                ).count()
                batch_id = variants[name][0](n)
                connection.close()
                seconds = timed_drain([worker], timeout=600)
                done = (
                    Job.objects.filter(task_name=bench.noop.name, state=JobState.SUCCEEDED).count()
                    - succeeded_before
                )
                if done != n:
                    result.notes.append(f"{name} round {round_no + 1}: {done} of {n} succeeded")
                if batch_id is not None:
                    row = Batch.objects.get(id=batch_id)
                    if row.state != BatchState.SUCCEEDED or row.succeeded != n:
                        result.notes.append(
                            f"{name} round {round_no + 1}: batch {row.state}, "
                            f"{row.succeeded} of {n} succeeded by its counters"
                        )
                if round_no >= 0:
                    rates[name].append(n / seconds)
                connection.close()
    for name, (_, what) in variants.items():
        result.figure(name, rates[name], "jobs/s", what=what)
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
